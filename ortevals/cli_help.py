"""The examples under each command's ``--help`` (click epilogs; ``\\b`` keeps their lines as written)."""

EPILOG_MMLU = """\b
Examples:
  ortevals mmlu-pro --example --limit 20          # SmolLM2-135M, bundled questions, offline
  ortevals mmlu-pro --pkg ./phi4-int4 --ep cuda --output runs/phi4
  ortevals mmlu-pro --pkg ./model --data ~/data/mmlu_pro --limit 100 --batch-size 4
  ortevals mmlu-pro --pkg ./model --model-args path=incremental,prefix_cache=false
  ortevals mmlu-pro --example --cot --limit 14 --max-gen-toks 256   # chain-of-thought generation
"""


EPILOG_RUN = """\b
Examples:
  ortevals run --pkg ./model --tasks arc_easy,hellaswag --limit 200
  ortevals run --pkg ./model --tasks wikitext --data ~/data/wikitext --batch-size 1
  ortevals run --pkg ./model --tasks gsm8k --apply-chat-template --gen-kwargs max_gen_toks=256
  ortevals run --pkg ./model --tasks gsm8k --model-args gen_batch_size=4,seed=7
"""


EPILOG_CACHE = """\b
Examples:
  ortevals cache info                     # what is stored, per kind, and each store's scopes
  ortevals cache clear                    # result stores and derived graphs (examples are kept)
  ortevals cache clear --examples         # only the example packages (a minute to rebuild)
  ortevals cache clear --all
"""


EPILOG_COMPARE = """\b
Examples:
  ortevals compare --ref runs/hf runs/fp32 runs/int4            # lm-eval hf run as the reference
  ortevals compare --ref runs/hf runs/int4 --report out/ --changed out/changed.jsonl
  ortevals compare --ref runs/fp32 runs/int4 --max-flip-rate 0.05 --max-kl 0.01 --margin 0.02   # CI gates
"""


EPILOG_FIDELITY = """\b
Examples:
  ortevals fidelity --pkg ./smollm2-int4 --ref ./smollm2-hf                 # PyTorch checkpoint (torch extra)
  ortevals fidelity --pkg ./smollm2-int4 --ref ./smollm2-fp32 --tokens 100000
  ortevals fidelity --pkg ./smollm2-int8 --ref ./smollm2-hf --save-ref ref.npz   # store the reference once
  ortevals fidelity --pkg ./smollm2-int4 --ref ref.npz --json int4.json          # reuse it, no reference model
"""


EPILOG_PROFILE = """\b
Examples:
  ortevals profile --example --batch 1,4 --prompt-len 128,512 --gen-len 64
  ortevals profile --pkg ./phi4-int4 --ep cuda --batch 1,4,16 --prompt-len 128,1024 --output prof/
"""


EPILOG_DIAGNOSE = """\b
Examples:
  ortevals diagnose --pkg ./smollm2-int4 --ref ./smollm2-fp32               # per layer, sensitivity, advice
  ortevals diagnose --pkg ./smollm2-int4 --ref ./smollm2-fp32 --checkpoint ./smollm2-hf --verify
  ortevals diagnose --pkg ./smollm2-int4 --ref ./smollm2-hf --budget 5 --questions 0   # checkpoint as reference
  ortevals diagnose --pkg ./model-int4 --ref ./model-fp16 --text my_domain.txt --tokens 4096 --output diag/
"""
