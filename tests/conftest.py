import os
import sys
from pathlib import Path

# Brute-force references live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
# DeepSpeed must not look for CUDA here, and its JIT op is compiled once into the repo's cache.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))
