import os
import sys
from pathlib import Path

# These tests compare Triton kernels run by the interpreter (on CPU tensors) with their torch
# references; test_triton_interpret.py starts them in a process with TRITON_INTERPRET=1.
assert os.environ.get("TRITON_INTERPRET") == "1", "run via tests/kernels/test_triton_interpret.py"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kernel_factories
