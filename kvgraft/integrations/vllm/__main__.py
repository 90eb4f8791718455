"""``python -m kvgraft.integrations.vllm MODE ...``: the exactness measurement, run inside vLLM's venv.

``kvgraft vllm exactness`` (kvgraft's own venv) starts this in ``.venv-vllm`` and reads the result
file it writes; see ``_internal/exactness.py``. The ``__main__`` guard matters: vLLM starts its
engine core in a child process, which imports the main module again.
"""

from __future__ import annotations

import sys

from ._internal.exactness import main

if __name__ == "__main__":
    sys.exit(main())
