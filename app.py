"""kvlab's web app: `python app.py` (or `make run`), then open http://127.0.0.1:7860.

GRADIO_SERVER_NAME / GRADIO_SERVER_PORT choose the address (default
127.0.0.1:7860; a Space sets 0.0.0.0). KVLAB_MODEL chooses the default model
(default: the embedded SmolLM2-135M-Instruct); KVLAB_MODELS offers more in
the model menu (comma-separated hub ids, local directories or .gguf files,
each loaded on first use). On a ZeroGPU Space the heavy functions run under
``spaces.GPU`` (KVLAB_GPU_DURATION, KVLAB_GPU_MAX_DURATION: their time slots in
seconds). The app itself lives in kvlab/ui.py.
"""
try:  # ZeroGPU wants `spaces` imported before anything initialises CUDA; elsewhere it is absent
    import spaces  # noqa: F401
except ImportError:
    pass

from kvlab.ui import main

if __name__ == "__main__":
    main()
