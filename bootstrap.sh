#!/usr/bin/env bash
# gptoss-host quick start (Debian 12, as root).
#   ./bootstrap.sh demo   install, boot the lab, ansible-playbook site.yml, invoke verify
#   ./bootstrap.sh test   install, then the whole test suite (what CI runs)
#   ./bootstrap.sh deps   install only
set -euo pipefail
cd "$(dirname "$0")"

install_deps() {
  if [ "$(id -u)" != 0 ]; then echo "bootstrap.sh: run as root (the lab needs systemd-nspawn and loop devices)" >&2; exit 2; fi
  # chromium + chromium-driver: the headless browser of the UI test (tests/test_webui.py).
  local packages=(debootstrap systemd-container openssh-client e2fsprogs util-linux iproute2 python3-venv python3-pip git
                  chromium chromium-driver)
  if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
  fi
  if [ ! -x .venv/bin/invoke ] || [ pyproject.toml -nt .venv/.installed ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[test]'
    touch .venv/.installed
  fi
}

case "${1:-}" in
  demo) install_deps; exec .venv/bin/invoke demo ;;
  test) install_deps; exec .venv/bin/invoke test ;;
  deps) install_deps ;;
  *) sed -n '2,6p' "$0"; exit 2 ;;
esac
