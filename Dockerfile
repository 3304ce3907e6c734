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

# Dependencies and the embedded model first, so code edits reuse this layer.
COPY --chown=user requirements.txt Makefile ./
RUN make setup
COPY --chown=user . .

EXPOSE 7860
CMD ["make", "run"]
