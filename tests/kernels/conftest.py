import os

# The interpreted Triton tests run in their own process with TRITON_INTERPRET=1 set before
# Triton is imported (test_triton_interpret.py starts it); a plain run must not collect them.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]
