#!/usr/bin/env bash
# Build the Arch package of this checkout and print its path (the only line on stdout).
#
#   packaging/arch/build.sh [--nocheck] [--pkgdest DIR] [--keep]
#
#   --nocheck      skip the PKGBUILD's check() (the unit tests)
#   --pkgdest DIR  where the package goes (default: dist/ of the checkout)
#   --keep         keep the scratch directory under /var/tmp (its path goes to stderr)
#
# makepkg refuses to run as root. As root this script builds as the system user gpuswapd-build
# (created if absent; as any other user it builds as that user), in a scratch copy of the
# checkout under /var/tmp, never in the checkout itself.
#
# On a host without pacman (Debian in CI) dependencies cannot be resolved: makepkg gets
# --nodeps, and the `python` that the PKGBUILD calls is the system python3 with what Arch's
# python would have installed: build, installer, hatchling, pytest, hypothesis and the runtime
# dependencies the unit tests import. They come from PyPI into a cache directory
# (/var/cache/gpuswapd-build as root), made once per requirement set. Debian's own
# python3-hatchling (1.12) is older than pyproject.toml's build requirement (>= 1.18), and
# Debian has no nvidia-ml-py. Python files land where that python3 installs system packages
# (Debian: usr/lib/python3/dist-packages, scripts in usr/bin).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
root=$(cd "$here/../.." && pwd -P)
BUILD_USER=gpuswapd-build

nocheck=() keep=0 pkgdest=$root/dist
while [ $# -gt 0 ]; do
    case $1 in
        --nocheck) nocheck=(--nocheck) ;;
        --keep) keep=1 ;;
        --pkgdest) pkgdest=${2:?--pkgdest needs a directory}; shift ;;
        --pkgdest=*) pkgdest=${1#--pkgdest=} ;;
        -h|--help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

say() { printf 'build.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# --- who builds -------------------------------------------------------------------------
if [ "$(id -u)" = 0 ]; then
    if ! id -u "$BUILD_USER" >/dev/null 2>&1; then
        say "creating the system user $BUILD_USER (makepkg refuses to run as root)"
        useradd --system --user-group --no-create-home --home-dir /nonexistent \
                --shell /usr/sbin/nologin --comment "gpuswapd package builds" "$BUILD_USER"
    fi
    as_builder() { runuser -u "$BUILD_USER" -- "$@"; }
    cache=/var/cache/gpuswapd-build
else
    as_builder() { "$@"; }
    cache=${XDG_CACHE_HOME:-$HOME/.cache}/gpuswapd-build
fi

# --- what makepkg needs on the host -------------------------------------------------------
missing=()
command -v makepkg >/dev/null || missing+=(makepkg)
command -v fakeroot >/dev/null || missing+=(fakeroot)
command -v bsdtar >/dev/null || missing+=(libarchive-tools)  # makepkg writes packages with bsdtar
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    else
        die "missing ${missing[*]}: install them first"
    fi
fi

# Arch (or a derivative) resolves the PKGBUILD's dependencies with pacman; anything else can't.
on_arch=0
if [ -r /etc/os-release ] && (. /etc/os-release; [[ " ${ID:-} ${ID_LIKE:-} " == *" arch "* ]]); then
    on_arch=1
fi

# --- the build tools for the system python3 (hosts without pacman) ------------------------
tools=""
if [ $on_arch = 0 ]; then
    py=/usr/bin/python3
    [ -x $py ] || die "no $py"
    # The requirements: the build and test tools, and the runtime dependencies the unit tests
    # import (PyGObject is compiled and not needed by them; tomli is for Python < 3.11).
    reqs=$($py - "$root/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))
build = project["build-system"]["requires"]
dev = {re.split(r"[<>=!~ ;\[]", d)[0].lower(): d for d in project["project"]["optional-dependencies"]["dev"]}
runtime = [d for d in project["project"]["dependencies"]
           if not d.lower().startswith(("pygobject", "pydbus", "tomli"))]
print("\n".join([*build, dev.get("build", "build"), dev.get("installer", "installer"), "wheel",
                 dev.get("pytest", "pytest"), dev.get("hypothesis", "hypothesis"), *runtime]))
EOF
)
    key=$( { $py -c 'import sys; print(sys.version)'; echo "$reqs"; cat "$root/tests/constraints.txt"; } | sha256sum | cut -c1-16)
    tools=$cache/tools-$key
    mkdir -p "$cache"
    exec 9>"$cache/.lock"
    flock 9
    if [ ! -d "$tools" ]; then
        say "installing the build tools for $py into $tools (once): $(echo $reqs)"
        rm -rf "$tools.tmp" "$cache/pip-venv"
        $py -m venv "$cache/pip-venv" >&2
        echo "$reqs" > "$cache/requirements.txt"
        "$cache/pip-venv/bin/pip" install --quiet --disable-pip-version-check --no-compile \
            -c "$root/tests/constraints.txt" -r "$cache/requirements.txt" --target "$tools.tmp" >&2
        rm -rf "$cache/pip-venv"
        chmod -R a+rX "$tools.tmp"
        mv "$tools.tmp" "$tools"
    fi
    exec 9>&-
fi

# --- a scratch copy of the checkout -------------------------------------------------------
scratch=$(mktemp -d /var/tmp/gpuswapd-build.XXXXXXXX)
cleanup() {
    if [ $keep = 1 ]; then say "kept $scratch"; else rm -rf "$scratch"; fi
}
trap cleanup EXIT
chmod 0755 "$scratch"
mkdir -p "$scratch/gpuswapd" "$scratch/out" "$scratch/home" "$scratch/bin"
tar -C "$root" -c --exclude-vcs --exclude=./.venv --exclude='./.*_cache' --exclude=./.hypothesis \
    --exclude=__pycache__ --exclude=./dist --exclude=./build --exclude=./packaging/arch/src \
    --exclude=./packaging/arch/pkg --exclude='*.pkg.tar*' . |
  tar -C "$scratch/gpuswapd" -x

path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
buildenv=()
if [ $on_arch = 0 ]; then
    # Arch's `python`: a wrapper, not a symlink, so that sys.executable (the scripts' shebang)
    # is /usr/bin/python3 and not this scratch directory.
    printf '#!/bin/sh\nexec /usr/bin/python3 "$@"\n' > "$scratch/bin/python"
    chmod 0755 "$scratch/bin/python"
    path=$scratch/bin:/usr/sbin:/usr/bin:/sbin:/bin
    buildenv=(PYTHONPATH="$tools")
    # Debian's python3 installs to /usr/local unless told that this is a package build.
    if /usr/bin/python3 -c 'import sys, sysconfig; sys.exit("deb_system" not in sysconfig.get_scheme_names())'; then
        buildenv+=(DEB_PYTHON_INSTALL_LAYOUT=deb_system)
    fi
fi
[ "$(id -u)" = 0 ] && chown -R "$BUILD_USER:" "$scratch"

# --- makepkg ------------------------------------------------------------------------------
depflags=()
if [ $on_arch = 0 ]; then
    # makepkg looks pacman up at start even with --nodeps (Debian's makepkg package does not
    # depend on pacman); PACMAN (makepkg(8)) names the command it would use, which --nodeps
    # never runs.
    depflags=(--nodeps)
    buildenv+=(PACMAN=true)
fi
say "building in $scratch as $(as_builder id -un)"
started=$(date +%s)
(
    cd "$scratch/gpuswapd/packaging/arch"
    as_builder env -i HOME="$scratch/home" PATH="$path" LANG=C.UTF-8 TERM=dumb \
        PKGDEST="$scratch/out" SRCDEST="$scratch/out" BUILDDIR="$scratch/gpuswapd/packaging/arch" \
        PACKAGER="gpuswapd build.sh <build@gpuswapd.invalid>" "${buildenv[@]}" \
        makepkg --config "$scratch/gpuswapd/packaging/arch/makepkg.conf" --noconfirm --nocolor \
                --cleanbuild --force "${depflags[@]}" "${nocheck[@]}" >&2
)
say "makepkg took $(( $(date +%s) - started ))s"

shopt -s nullglob
built=("$scratch"/out/*.pkg.tar*)
[ ${#built[@]} = 1 ] || die "expected one package in $scratch/out, found: ${built[*]:-none}"
mkdir -p "$pkgdest"
install -m 0644 "${built[0]}" "$pkgdest/"
echo "$(cd "$pkgdest" && pwd -P)/$(basename "${built[0]}")"
