"""onnxruntime-genai's Generators for generate_until: the rewinding cursor's loop, batched greedy
rows (``loops.py``) and which requests run on which (``schedule.py``).
"""
