"""Weight quantization: `mlx-lane quantize` (cli.py), uniform / sensitivity-mixed / rotation-folded quantization
(quantize.py, rotation.py), and its quality against the float model on held-out text (evaluate.py, data.py)."""
