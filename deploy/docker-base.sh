#!/usr/bin/env bash
# Makes a Debian base image for Dockerfile.dev from Debian's packages, for machines where no image registry is
# reachable (so `FROM python:3.11-slim-bookworm` cannot be pulled) but a Debian mirror is.
#
#   deploy/docker-base.sh [TAG]        # default TAG: mlx-lane-base:bookworm; does nothing when TAG exists
#
# The image is Debian bookworm (minbase) + python3 (3.11) + python3-venv + ca-certificates: what Dockerfile.dev
# needs from python:3.11-slim-bookworm. CA certificates this machine added under /usr/local/share/ca-certificates
# (e.g. a TLS-inspecting egress proxy's) are trusted inside too, so pip works in the image wherever it works here.
# Needs root, debootstrap (installed with apt-get when missing) and a running Docker engine.
set -euo pipefail
TAG=${1:-mlx-lane-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG already exists (docker rmi $TAG to remake it)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "making the base image needs root (debootstrap + chroot): sudo $0 $TAG" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  command -v apt-get >/dev/null 2>&1 || { echo "debootstrap is missing and there is no apt-get to install it" >&2; exit 1; }
  echo "installing debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

work=$(mktemp -d /var/tmp/mlx-lane-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
echo "debootstrap $SUITE from $MIRROR into $root (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR" \
  > "$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; exit 1; }

cat > "$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
SOURCES
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
# What a registry's Debian image leaves out: downloaded packages and package lists (apt-get update refills them).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log

tar --numeric-owner -C "$root" -c . | docker import \
  -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'ENV LANG=C.UTF-8' \
  -c 'CMD ["bash"]' \
  -m "debootstrap --variant=minbase $SUITE + python3, python3-venv, ca-certificates" \
  - "$TAG" >/dev/null
echo "made base image $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
