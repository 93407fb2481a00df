# Ridgeline agent image (OCI). Two stages:
#   build    compiler, make and the pinned build requirements: scripts/install.sh builds the
#            wheel (which compiles the CUPTI injection library) into /opt/ridgeline/venv
#            and the native trace reader (probes/native_json, against the distro's libsimdjson-dev)
#   runtime  the distro Python, libsimdjson (the trace reader's), the distro bcc (python3-bpfcc, never PyPI's `bcc`) and a
#            fallback kernel header tree, plus the venv; no compiler, no pip cache
# Both stages use the same Debian release, so the venv's interpreter (/usr/bin/python3) is
# the one it was built with. Kernel headers: the entrypoint prefers the node's (mounted at
# /host), else links the image's, as scripts/setup-ebpf.sh does on a host.
# The last USER is unprivileged: `ridgeline tail/top/analyze` need nothing more. The agent
# needs eBPF: the DaemonSet (deploy/kubernetes/daemonset.yaml) runs it as uid 0 with every
# capability dropped except CAP_BPF, CAP_PERFMON, CAP_SYS_RESOURCE and CAP_SYS_PTRACE.
#
#   podman build -t ridgeline-agent:0.1.0 .          (or docker/buildah; see docs/deploy.md)
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      python3 python3-venv gcc g++ make libc6-dev libsimdjson-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# Behind a TLS-intercepting proxy: mount its CA bundle into the build and name it here
# (--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/proxy-ca.crt:ro --build-arg
# PIP_CERT=/etc/ssl/proxy-ca.crt); unset otherwise. Build stage only.
ARG PIP_CERT
WORKDIR /src
COPY . /src
# --no-ebpf: bcc belongs to the runtime stage; install.sh still builds the library and checks it.
RUN bash scripts/install.sh --no-ebpf \
 && /opt/ridgeline/venv/bin/python -I -c "from ridgeline.probes.cupti.library import library_path as p; assert p().is_file(), p()" \
 && /opt/ridgeline/venv/bin/python -I -c "from ridgeline.probes.kineto_native import library_path as p; assert p().is_file(), p()" \
 && find /opt/ridgeline/venv -name __pycache__ -prune -exec rm -rf {} +

FROM ${BASE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      python3 python3-bpfcc libsimdjson14 "linux-headers-$(dpkg --print-architecture)" ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/ridgeline /opt/ridgeline
COPY --from=build /etc/ridgeline/agent.toml /etc/ridgeline/agent.toml
COPY scripts/link-bcc.sh deploy/container/entrypoint.sh /opt/ridgeline/bin/
COPY deploy/kubernetes/seccomp/ridgeline-agent.json /opt/ridgeline/share/seccomp/
RUN bash /opt/ridgeline/bin/link-bcc.sh /opt/ridgeline/venv \
 && /opt/ridgeline/venv/bin/python -c "import bcc; assert hasattr(bcc, 'BPF')" \
 && install -d -m 0755 /opt/ridgeline/lib \
 && ln -s /opt/ridgeline/venv/lib/python3*/site-packages/ridgeline/probes/native/libridgeline_cupti.so /opt/ridgeline/lib/ \
 && chmod 0755 /etc/ridgeline && chmod 0644 /etc/ridgeline/agent.toml \
 && useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin ridgeline
ENV PATH=/opt/ridgeline/venv/bin:$PATH
LABEL org.opencontainers.image.title="ridgeline-agent" \
      org.opencontainers.image.description="Ridgeline low-overhead profiling agent for GPU hosts serving LLMs" \
      org.opencontainers.image.licenses="Apache-2.0"
EXPOSE 9464
USER 10001
ENTRYPOINT ["/opt/ridgeline/bin/entrypoint.sh"]
CMD ["agent", "--config", "/etc/ridgeline/agent.toml"]
