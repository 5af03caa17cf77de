# A p2pcoll peer as a service: `p2pcoll peer --job MODULE:FUNCTION`, with /healthz, /readyz and /metrics
# on $P2PCOLL_METRICS_PORT. By default it trains the digits classifier (examples/digits_job.py):
#
#   docker build -t p2pcoll .
#   docker run --rm p2pcoll                                   # a group of one
#   docker run -e P2PCOLL_RENDEZVOUS=tcp://peer0:29500 -e WORLD_SIZE=4 -e RANK=1 \
#       -v "$PWD/job.key:/run/secrets/p2pcoll-job-key:ro" \
#       -e P2PCOLL_KEY_FILE=/run/secrets/p2pcoll-job-key p2pcoll      # one of four peers
#
# examples/compose.yaml and examples/k8s/ run four. Nothing secret is in the image: the job key
# (`p2pcoll keygen`) comes in by a mount or a Secret, readable by uid 10001 (the image's user).
#
# BASE_IMAGE: any Debian-like image with python3 >= 3.11 and its venv module (the official
# python:3.11-slim, or Debian's python3 + python3-venv). The package index: pip's defaults, or a
# pip.conf handed in as a build secret, which is not kept in any layer:
#   docker build --secret id=pip.conf,src=/etc/pip.conf .
ARG BASE_IMAGE=python:3.11-slim

# --- the wheel, built from the source as `pip wheel` does for users -----------------------------
FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
# The dependencies (the core's, and the `service` and `examples` extras') listed from
# pyproject.toml alone: the image installs them in a layer of their own, rebuilt only when
# this list changes, not when the code or the rest of pyproject.toml does.
COPY pyproject.toml ./
RUN python3 -c "import sys, tomllib; \
p = tomllib.load(open('pyproject.toml', 'rb'))['project']; e = p['optional-dependencies']; \
print(*p['dependencies'], *e['service'], *e['examples'], sep='\n')" >/requirements.txt
# What the build needs: the metadata (pyproject.toml; setup.py lists the packages), the README
# (the long description), the package and the built-in strategies (p2pcoll_plugins).
COPY setup.py README.md ./
COPY p2pcoll ./p2pcoll
COPY plugins ./plugins
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- the image ------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# A virtualenv, not the system's Python: Debian's is externally managed (PEP 668).
RUN python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 --user-group peer

# The dependencies, in a layer of their own (see the wheel stage).
COPY --from=wheel /requirements.txt /tmp/
RUN --mount=type=secret,id=pip.conf,target=/etc/pip.conf \
    pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The package itself, from the wheel (not editable): the image runs what users install. Its
# dependencies are all there already (pip check says so if one were missing).
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/*.whl \
    && pip check \
    && rm -rf /tmp/dist

# The examples, to run as jobs (`--job examples.digits_job:job`) or scripts (`launch -n 2 --
# python examples/allreduce_demo.py`); /app is the working directory, so it is on sys.path.
WORKDIR /app
COPY examples ./examples

USER 10001:10001
# 29500: the rendezvous, hosted by rank 0 (P2PCOLL_RENDEZVOUS=tcp://RANK0:29500). The peers'
# own links bind ports the system picks, announced at the rendezvous. 9090: /healthz, /readyz, /metrics.
ENV P2PCOLL_METRICS_PORT=9090
EXPOSE 29500 9090
# Healthy while the peer answers (/healthz: liveness, 200 in every state; a stuck event loop
# gives no answer). Whether it is ready to take part in collectives is /readyz (503 while
# forming, degraded, broken or closed): Kubernetes' readinessProbe uses it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; print(urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['P2PCOLL_METRICS_PORT'], timeout=4).read().decode())"]
ENTRYPOINT ["p2pcoll"]
CMD ["peer", "--job", "examples.digits_job:job"]
