#!/usr/bin/env bash
# Build the server and worker images (server/Containerfile, server/Containerfile.worker) and,
# with --smoke, run them: a server container, a worker container training against it on the
# host network, and `asyncdiloco status` seeing the worker.
#
#   scripts/build_images.sh [--local-base] [--smoke]
#
#   --local-base  build the base image from Debian (debootstrap bookworm with python3 and venv,
#                 imported into the engine as localhost/asyncdiloco-base:bookworm), for machines
#                 that reach Debian's mirror and PyPI but no image registry; default: the
#                 Containerfiles' python:3.11-slim
#   --smoke       run the images afterwards (port SMOKE_PORT, default 29651, on 127.0.0.1)
#
# Environment: ENGINE (podman; docker takes the same commands), TAG (dev), BUILD_FLAGS and
# RUN_FLAGS (extra engine flags, e.g. "--runtime runc --ulimit nofile=4096:4096
# --ulimit nproc=4096:4096" where the sandbox lacks CAP_SYS_RESOURCE and crun refuses hybrid
# cgroups: see server/README.md), TORCH (torch==2.13.0), TORCH_INDEX (the Containerfiles'
# default: PyTorch's CPU index; "" for the default index), WHEELS (a host folder of wheels,
# mounted into the build), CA_BUNDLE (a host CA bundle for pip, mounted into the build).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-podman}
TAG=${TAG:-dev}
read -r -a BUILD <<<"${BUILD_FLAGS:-}"
read -r -a RUN <<<"${RUN_FLAGS:-}"
LOCAL_BASE=0 SMOKE=0
for arg in "$@"; do
    case "$arg" in
        --local-base) LOCAL_BASE=1 ;;
        --smoke) SMOKE=1 ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument $arg: give --local-base and/or --smoke" >&2; exit 2 ;;
    esac
done

if ! command -v "$ENGINE" >/dev/null 2>&1; then
    echo "container engine '$ENGINE' not found: install podman (apt-get install podman) or set ENGINE=docker" >&2
    exit 2
fi
args=(--network host --build-arg "TORCH=${TORCH:-torch==2.13.0}")
[ -n "${TORCH_INDEX+set}" ] && args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
[ -n "${WHEELS:-}" ] && args+=(-v "$WHEELS:/wheels:ro" --build-arg WHEELS=/wheels)
[ -n "${CA_BUNDLE:-}" ] && args+=(-v "$CA_BUNDLE:/etc/host-ca.crt:ro" --build-arg PIP_CERT=/etc/host-ca.crt)

if [ "$LOCAL_BASE" = 1 ]; then
    base=localhost/asyncdiloco-base:bookworm
    if ! "$ENGINE" image exists "$base" 2>/dev/null; then
        rootfs=$(mktemp -d /var/tmp/asyncdiloco-rootfs.XXXXXX)
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
            http://deb.debian.org/debian
        tar -C "$rootfs" -c . | "$ENGINE" import --change 'CMD ["/bin/bash"]' - "$base"
        rm -rf "$rootfs"
    fi
    args+=(--build-arg "BASE=$base")
fi

"$ENGINE" build "${BUILD[@]}" "${args[@]}" -f server/Containerfile -t "localhost/asyncdiloco-server:$TAG" .
"$ENGINE" build "${BUILD[@]}" "${args[@]}" -f server/Containerfile.worker -t "localhost/asyncdiloco-worker:$TAG" .
[ "$SMOKE" = 1 ] || exit 0

port=${SMOKE_PORT:-29651}
server=asyncdiloco-smoke-server
trap '"$ENGINE" rm -f "$server" >/dev/null 2>&1 || true' EXIT
"$ENGINE" run -d --name "$server" "${RUN[@]}" --network host "localhost/asyncdiloco-server:$TAG" \
    --host 127.0.0.1 --port "$port" --local-steps 10
"$ENGINE" run --rm "${RUN[@]}" --network host "localhost/asyncdiloco-worker:$TAG" \
    --server "127.0.0.1:$port" --worker-name smoke-worker --max-seconds 25 --log-every 50 &
worker=$!
sleep 15  # the worker is mid-training: status must list it
"$ENGINE" run --rm "${RUN[@]}" --network host --entrypoint asyncdiloco "localhost/asyncdiloco-server:$TAG" \
    status --server "127.0.0.1:$port" | tee /dev/stderr | grep -q "smoke-worker"
wait "$worker"
"$ENGINE" stop -t 20 "$server" >/dev/null
"$ENGINE" logs "$server" 2>&1 | tail -1
echo "smoke: the worker container trained against the server container and status listed it"
