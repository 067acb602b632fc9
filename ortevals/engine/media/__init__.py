"""Requests with images or audio: og's multimodal pipeline, or og's processor then raw onnxruntime
with shared text-prefix KV (the fast path), chosen per package."""
