#!/usr/bin/env bash
# setup-deps.sh: makes sure the Debian packages reflux needs to build and test are installed.
#
# Checks each package with dpkg. As root it installs the missing ones with apt-get (after an
# apt-get update); otherwise it prints the exact command to run and exits non-zero. It does
# nothing on systems without dpkg except say so: install the equivalents by hand there.
set -euo pipefail

# ---- Packages needed now ----------------------------------------------------------------
PACKAGES=(
    cmake
    gcc
    g++
    make
    pkg-config
    zlib1g-dev
    dataset-fashion-mnist
    libdnnl-dev
)


if ! command -v dpkg >/dev/null 2>&1; then
    echo "setup-deps: dpkg not found; make sure these are installed: ${PACKAGES[*]}" >&2
    exit 0
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg -s "$pkg" 2>/dev/null | grep -q '^Status: install ok installed'; then
        missing+=("$pkg")
    fi
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "setup-deps: all required packages are installed"
    exit 0
fi

install_cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "setup-deps: missing packages: ${missing[*]}" >&2
    echo "setup-deps: install them with:" >&2
    echo "    sudo apt-get update && sudo $install_cmd" >&2
    exit 1
fi

echo "setup-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
$install_cmd
