"""What a package folder holds: genai_config.json, its ONNX graphs, the tokenizer; nothing opened until needed."""
