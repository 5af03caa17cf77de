# A p2pcoll peer image. The container issue completes this (compose/Kubernetes examples,
# health checks); it is not built in CI yet.
FROM python:3.11-slim

RUN useradd --create-home --uid 10001 peer
# What the build needs: the metadata (pyproject.toml; setup.py lists the packages), the
# README (the long description), the package and the built-in strategies (p2pcoll_plugins).
# Built in /src and then removed, so the image runs the installed package, as users do.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY p2pcoll ./p2pcoll
COPY plugins ./plugins
RUN pip install --no-cache-dir /src && cd / && rm -rf /src

# Not needed to build; there to run: `docker run IMAGE launch -n 2 -- python examples/...`.
WORKDIR /app
COPY examples ./examples

USER peer
# Peers find each other through P2PCOLL_RENDEZVOUS (tcp://HOST:PORT), WORLD_SIZE and RANK.
ENTRYPOINT ["p2pcoll"]
CMD ["strategies"]
