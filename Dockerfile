# outboxd container image: a Debian 12 build stage compiles build/outboxd
# with the project's Makefile; the runtime stage holds only the shared
# libraries, the binary, the SQL and a config.  See docs/OPERATIONS.md.

# --- build -----------------------------------------------------------------
FROM debian:bookworm-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
	gcc libc6-dev make pkg-config \
	libpq-dev librabbitmq-dev libhiredis-dev libyaml-dev \
	libsystemd-dev libmicrohttpd-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Only what the build reads, so editing docs or tests does not rebuild.
COPY Makefile ./
COPY daemon/ daemon/
COPY sql/ sql/
# The Makefile's default goal (`make` = `make all`) builds build/outboxd,
# exactly as on a developer's machine.
RUN make -j"$(nproc)" all && build/outboxd version

# --- runtime ---------------------------------------------------------------
FROM debian:bookworm-slim
# Runtime libraries only: the -dev packages and the compiler stay behind.
# ca-certificates lets rabbitmq.tls verify a broker with the system CAs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
	libpq5 librabbitmq4 libhiredis0.14 libyaml-0-2 libsystemd0 \
	libmicrohttpd12 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home \
	--home-dir /nonexistent --shell /usr/sbin/nologin outboxd
COPY --from=build /src/build/outboxd /usr/local/bin/outboxd
COPY sql/ /usr/local/share/outboxd/sql/
# The default config talks to the docker-compose service names and
# listens on 0.0.0.0:9187; mount your own file over it.  It holds no
# secrets: passwords come from the environment (password_env).
COPY config/docker.yml /etc/outboxd/outboxd.yml
USER outboxd
EXPOSE 9187
# Health probe without curl: bash (always in Debian) opens /dev/tcp and
# reads the status line of GET /healthz.  No extra package, no extra
# attack surface; the timeout covers a listener that never answers.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
	CMD ["timeout", "4", "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9187 && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["outboxd"]
CMD ["-c", "/etc/outboxd/outboxd.yml", "run"]
