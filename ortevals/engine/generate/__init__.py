"""Generation: gen_kwargs to decoding settings, token choice, stops, beam search and MBR, the raw
path's sampler and its KV rows, og's Generator loops, their scheduling and the generation canary."""
