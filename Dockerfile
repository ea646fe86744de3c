# metalog images.
#   docker build --target broker -t metalog:latest .        brokers and the CLI: the base package,
#                                                           no pyspark, pandas, matplotlib or Java
#   docker build --target spark  -t metalog-spark:latest .  adds the [spark] and [bench] extras and a
#                                                           Java runtime: the Spark job and the drill
# docker-compose.yml builds both.

# ---- build: install the base package into a virtualenv we can copy ---------
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/metalog
WORKDIR /src
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY protocol ./protocol
COPY storage ./storage
COPY sim ./sim
COPY tools ./tools
RUN /opt/metalog/bin/pip install .

# ---- build-tools: the same virtualenv plus the [spark] and [bench] extras ---
FROM build AS build-tools
RUN /opt/metalog/bin/pip install '.[spark,bench]'

# ---- broker: the runtime image (non-root) ----------------------------------
FROM python:3.11-slim AS broker
RUN groupadd --system --gid 10001 metalog \
 && useradd --system --uid 10001 --gid metalog --home-dir /var/lib/metalog --shell /usr/sbin/nologin metalog \
 && mkdir -p /var/lib/metalog /var/lib/metalog-drill /etc/metalog \
 && chown -R metalog:metalog /var/lib/metalog /var/lib/metalog-drill
COPY --from=build /opt/metalog /opt/metalog
# The compose file is in the image so `metalog cluster up --compose` works inside it too.
COPY docker-compose.yml /opt/metalog/share/docker-compose.yml
ENV PATH=/opt/metalog/bin:$PATH PYTHONUNBUFFERED=1
USER metalog
WORKDIR /var/lib/metalog
# Named volumes are created from these paths and inherit the owner.
VOLUME ["/var/lib/metalog"]
EXPOSE 9091 8091
ENTRYPOINT []
CMD ["metalog", "--help"]

# ---- spark: the broker image plus the extras and a Java runtime, for -------
# ---- `metalog spark ...` and `metalog drill` (its report picture) ----------
FROM broker AS spark
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /out && chown metalog:metalog /out
COPY --from=build-tools /opt/metalog /opt/metalog
USER metalog
