"""The GPU tests (``gpu/``) need torch and a CUDA GPU and fail without them, so a run over
``tests/`` leaves them out unless ``FERRY_GPU_TESTS=1`` (scripts/gpu-python.sh sets it); naming
``tests/gpu`` explicitly always runs them."""

import os

collect_ignore = [] if os.environ.get("FERRY_GPU_TESTS") == "1" else ["gpu"]
