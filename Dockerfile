# A p2pcoll peer image. The container issue completes this (compose/Kubernetes examples,
# health checks); it is not built in CI yet.
FROM python:3.11-slim

RUN useradd --create-home --uid 10001 peer
WORKDIR /app
COPY pyproject.toml README.md ./
COPY p2pcoll ./p2pcoll
COPY plugins ./plugins
COPY examples ./examples
RUN pip install --no-cache-dir .

USER peer
# Peers find each other through P2PCOLL_RENDEZVOUS (tcp://HOST:PORT), WORLD_SIZE and RANK.
ENTRYPOINT ["p2pcoll"]
CMD ["strategies"]
