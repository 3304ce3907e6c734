# A Docker Space (or any container host): the same steps as `make run`.
FROM python:3.12-slim

RUN apt-get update && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
RUN useradd -m -u 1000 user
USER user
WORKDIR /home/user/app
ENV HOME=/home/user \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False \
    PYTHON=python3

# The pinned dependencies first, so code edits reuse this (slow) layer; then
# `make setup` as everywhere else (the embedded model, Gemma 3 270M assembled and
# dequantised into ~/.cache/kvlab/models, about 1.3 GB, so the image serves it at
# once, and kvlab itself).
COPY --chown=user requirements.txt ./
RUN python3 -m venv .venv && .venv/bin/python -m pip install -q -r requirements.txt
COPY --chown=user . .
RUN make setup

EXPOSE 7860
CMD ["make", "run"]
