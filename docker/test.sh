#!/usr/bin/env bash
# make docker-test: prove docker/Dockerfile on a machine without a Docker engine.
#
#  1. installs buildah, podman and debootstrap (apt) when they are missing;
#  2. makes a local stand-in for the image's base (no registry image can be pulled here):
#     Debian bookworm (Python 3.11) from debootstrap, trusting this machine's CA bundle, so
#     that pip inside the build reaches the package registry through this machine's proxy;
#  3. builds docker/Dockerfile unchanged with `buildah bud --isolation chroot`, only
#     BASE (and, where this machine has local package indexes, a read-only mount of them
#     and PIP_EXTRA_INDEX_URL) passed from outside;
#  4. runs the demo recipe in the image with two processes (torchrun, gloo on the CPU) as
#     the image's non-root user and checks that it trains: metrics.jsonl with every epoch,
#     world_size 2, falling loss, test accuracy well above chance (10 classes).
#
# Needs root (debootstrap, buildah's chroot isolation). Knobs (environment):
#   DOCKER_TEST_WORK=/var/tmp/distlib-docker-test  scratch (the stand-in's rootfs)
#   DOCKER_TEST_FRESH=1    rebuild the stand-in base and the image without build cache
#   DOCKER_TEST_LOCAL_INDEX=0   ignore local package indexes: every wheel from the registry
#   DOCKER_TEST_EPOCHS=3   epochs of the demo inside the image
#   DEBIAN_MIRROR=URL      instead of the mirror in this machine's apt sources
set -euo pipefail

cd "$(dirname "$0")/.."
WORK=${DOCKER_TEST_WORK:-/var/tmp/distlib-docker-test}
BASE_IMAGE=localhost/distlib-standin:bookworm
IMAGE=localhost/distlib:test
EPOCHS=${DOCKER_TEST_EPOCHS:-3}
MIN_ACC=0.25 # chance is 0.10; three epochs of the demo reach about 0.4
T0=$SECONDS

say() { printf '\n[docker-test %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() {
    printf '\n[docker-test] FAILED: %s\n' "$*" >&2
    exit 1
}

if [ "$(id -u)" != 0 ]; then
    command -v sudo > /dev/null || die "needs root (debootstrap, buildah --isolation chroot) and there is no sudo"
    say "needs root (debootstrap, buildah --isolation chroot): running under sudo"
    exec sudo --preserve-env=DOCKER_TEST_WORK,DOCKER_TEST_FRESH,DOCKER_TEST_LOCAL_INDEX,DOCKER_TEST_EPOCHS,DEBIAN_MIRROR bash "$0" "$@"
fi

# ---- 1. tools ------------------------------------------------------------------------------
missing=()
for tool in buildah podman debootstrap; do command -v "$tool" > /dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} with apt-get"
    apt_install() {
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
            --no-install-recommends "${missing[@]}"
    }
    apt_install || { apt-get -o DPkg::Lock::Timeout=600 update -q && apt_install; }
fi
say "tools: $(buildah --version | cut -d' ' -f1-3), $(podman --version), debootstrap $(dpkg-query -W -f='${Version}' debootstrap)"

# ---- 2. the stand-in base image --------------------------------------------------------------
debian_mirror() {
    # The first Debian archive URI in the apt sources (deb822 "URIs:" or one-line "deb URI suite").
    local uri
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2> /dev/null |
        grep -v '^\s*#' | grep -oE '(https?|file)://[^ ]*/debian/?( |$)' | head -n1 | tr -d ' ')
    echo "${uri:-http://deb.debian.org/debian}"
}

if [ "${DOCKER_TEST_FRESH:-0}" = 1 ]; then
    say "DOCKER_TEST_FRESH=1: removing $IMAGE and $BASE_IMAGE from earlier runs"
    buildah rmi -f "$IMAGE" "$BASE_IMAGE" > /dev/null 2>&1 || true
fi
if ! buildah inspect --type image "$BASE_IMAGE" > /dev/null 2>&1; then
    mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
    say "making the stand-in base $BASE_IMAGE: debootstrap --variant=minbase bookworm from $mirror"
    rm -rf "$WORK/rootfs"
    mkdir -p "$WORK"
    # python3-venv: the Dockerfile makes a virtual environment; netbase: /etc/services and
    # /etc/protocols, as in python:3.11-slim.
    debootstrap --variant=minbase --include=python3,python3-venv,netbase bookworm "$WORK/rootfs" "$mirror" \
        > "$WORK/debootstrap.log" 2>&1 || {
        tail -n 20 "$WORK/debootstrap.log"
        die "debootstrap (log: $WORK/debootstrap.log)"
    }
    # Trust what this machine trusts (its registry traffic goes through a proxy with its own
    # CA). This belongs to the stand-in, never to the project's Dockerfile.
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    tar -C "$WORK/rootfs" -c . | podman import -q \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        - "$BASE_IMAGE" > /dev/null
    rm -rf "$WORK/rootfs"
    probe=$(buildah from -q "$BASE_IMAGE")
    say "stand-in base ready: $(buildah run --isolation chroot "$probe" -- python3 --version)"
    buildah rm "$probe" > /dev/null
else
    say "reusing the stand-in base $BASE_IMAGE (DOCKER_TEST_FRESH=1 remakes it)"
fi

# ---- 3. build the project's Dockerfile --------------------------------------------------------
build_args=(--build-arg "BASE=$BASE_IMAGE")
if [ "${DOCKER_TEST_LOCAL_INDEX:-1}" = 1 ]; then
    # This machine may keep PyPI wheels (torch's CUDA build among them) in local file://
    # indexes named in its pip configuration. Mount them read-only into the build and name
    # them in PIP_EXTRA_INDEX_URL, an optional build argument of the Dockerfile (a mirror, for
    # real users): pip then takes those files instead of downloading ~3 GB. The registry
    # stays the main index, so the image holds exactly what a plain build installs.
    extra=""
    for url in $(python3 -m pip config get global.extra-index-url 2> /dev/null || true); do
        dir=${url#file://}
        if [ "$dir" = "$url" ] || [ ! -d "$dir" ]; then continue; fi # not a local folder
        root=$(dirname "$dir") # the index's HTML links to ../../files/...
        build_args+=(--volume "$root:$root:ro")
        extra="$extra $url"
    done
    if [ -n "$extra" ]; then
        build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=${extra# }")
        say "local package indexes mounted into the build:$extra"
    fi
fi
[ "${DOCKER_TEST_FRESH:-0}" = 1 ] && build_args+=(--no-cache)

say "building docker/Dockerfile -> $IMAGE (buildah bud --isolation chroot; torch's CUDA wheels are several GB)"
t_build=$SECONDS
mkdir -p "$WORK"
set +e # the full log goes to build.log; the terminal gets it without pip's per-file lines
buildah bud --isolation chroot --layers -f docker/Dockerfile "${build_args[@]}" -t "$IMAGE" . 2>&1 |
    tee "$WORK/build.log" |
    grep --line-buffered -vE '^\s*(━|Downloading|Collecting|Requirement already|Processing|Using cached|WARNING: Location .* is ignored)'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" = 0 ] || die "buildah bud (exit $rc; full log: $WORK/build.log)"
say "built in $((SECONDS - t_build)) s; $(buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE")"

# ---- 4. run the demo inside the image ---------------------------------------------------------
# As under Docker, the container's hostname resolves (torchrun's c10d rendezvous and gloo look it up).
ctr=$(buildah from -q --add-host distlib-test:127.0.0.1 "$IMAGE")
trap 'buildah rm "$ctr" > /dev/null 2>&1 || true' EXIT
in_image() { buildah run --isolation chroot --hostname distlib-test "$ctr" -- "$@"; }

user=$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE")
cmd=$(buildah inspect --type image --format '{{.OCIv1.Config.Cmd}}' "$IMAGE")
say "image: user=$user cmd=$cmd; $(in_image python -c 'import os, pwd, torch, torchvision; print(f"uid={os.getuid()} ({pwd.getpwuid(os.getuid()).pw_name}) torch={torch.__version__} cuda={torch.version.cuda} torchvision={torchvision.__version__}")')"
[ "$user" = distlib ] || die "the image should run as the non-root user distlib, not '$user'"
case "$cmd" in *torchrun*) ;; *) die "the default command should run torchrun, got $cmd" ;; esac

say "training the demo in the image: torchrun --standalone --nproc-per-node=2 -m distlib.runner recipes/demo.yaml train.epochs=$EPOCHS"
t_run=$SECONDS
in_image torchrun --standalone --nproc-per-node=2 -m distlib.runner recipes/demo.yaml \
    "train.epochs=$EPOCHS" run.out_dir=runs/docker-test || die "the demo failed inside the image"
say "trained in $((SECONDS - t_run)) s; checking runs/docker-test/metrics.jsonl"

in_image python - "$EPOCHS" "$MIN_ACC" << 'EOF' || die "the run inside the image did not train"
import json, sys

epochs, min_acc = int(sys.argv[1]), float(sys.argv[2])
rows = [json.loads(line) for line in open("runs/docker-test/metrics.jsonl")]
for r in rows:
    print(f"  epoch {r['epoch']}: train_loss {r['train_loss']:.3f} test_acc {r['test_acc']:.3f} world_size {r['world_size']}")
assert [r["epoch"] for r in rows] == list(range(1, epochs + 1)), f"epochs {[r['epoch'] for r in rows]}"
assert all(r["world_size"] == 2 for r in rows), "world_size is not 2"
assert rows[-1]["train_loss"] < rows[0]["train_loss"], "the loss did not fall"
assert rows[-1]["test_acc"] >= min_acc, f"test accuracy {rows[-1]['test_acc']} < {min_acc}"
EOF

say "as a uid the image does not know (docker run --user \"\$(id -u)\"): decoding the demo data into /cache"
ctr2=$(buildah from -q "$IMAGE")
trap 'buildah rm "$ctr" "$ctr2" > /dev/null 2>&1 || true' EXIT
buildah run --isolation chroot --user 4321:4321 "$ctr2" -- python -c '
import os
from distlib.runner.data.images import default_cache_dir, load_image_set
s = load_image_set("data/cifar10-demo")
print(f"  uid {os.getuid()}: {len(s.y_train)} train images, cache {os.listdir(default_cache_dir())} in {default_cache_dir()}")
' || die "an arbitrary uid cannot use the image's cache directory"

say "PASSED: the image builds and trains the demo on 2 processes (total $((SECONDS - T0)) s)"
