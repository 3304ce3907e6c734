"""kvlab's web app: `python app.py` (or `make run`), then open http://127.0.0.1:7860.

GRADIO_SERVER_NAME / GRADIO_SERVER_PORT choose the address (default
127.0.0.1:7860; a Space sets 0.0.0.0); KVLAB_MODEL chooses the model
(default: the embedded SmolLM2-135M-Instruct). The app itself lives in
kvlab/ui.py.
"""
from kvlab.ui import main

if __name__ == "__main__":
    main()
