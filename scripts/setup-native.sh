#!/usr/bin/env bash
# setup-native.sh: build prerequisites of Ridgeline's native part (the CUPTI injection
# library, probes/native), idempotent and fast when already done.
#
# Needs only a C compiler and make; the CUPTI headers come from the nvidia-cuda-cupti
# wheel that scripts/setup.sh installs into .venv (or a CUDA toolkit). Installs gcc/make
# from the distro when missing and we are root. Exit status 0 when a compiler and make
# are there; 1 with a one-line reason otherwise (scripts/setup.sh carries on: the agent
# runs without the injection library, the CUPTI probe then says why).
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
# the native trace reader (probes/native_json) also needs g++ and the distro's simdjson
have_simdjson() { [ -f /usr/include/simdjson.h ]; }
if have make && { have cc || have gcc; } && have g++ && have_simdjson; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "setup-native: no C/C++ compiler, make or libsimdjson-dev, and not root: cannot install them" >&2
    exit 1
fi
if ! have apt-get; then
    echo "setup-native: no C/C++ compiler, make or libsimdjson-dev, and no apt-get: install gcc, g++, make and simdjson" >&2
    exit 1
fi
# shellcheck source=scripts/apt.sh
. "$(dirname "$0")/apt.sh"
apt_install gcc g++ make libc6-dev libsimdjson-dev || { echo "setup-native: installing gcc/g++/make/libsimdjson-dev failed (see above)" >&2; exit 1; }
have make && have cc && have g++ && have_simdjson
