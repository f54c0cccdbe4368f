#!/usr/bin/env bash
# Entrypoint of the ringlab image. A Ray driver must run on a Ray node (ray.init(address=...) looks
# for a local raylet), so with RINGLAB_JOIN_RAY=1 (the api and scheduler services of
# docker-compose.yml) this container first joins the cluster at RINGLAB_RAY_ADDRESS as a node that
# offers no CPUs and no GPUs (rank actors never land here), then runs the command.
set -euo pipefail
for var in RINGLAB_API_TOKEN RAY_AUTH_TOKEN PGPASSWORD POSTGRES_PASSWORD; do
  case "${!var:-}" in
    change-me*)
      echo "error: $var is still the example's change-me value: set a secret in deploy/ringlab.env" >&2
      exit 1
      ;;
  esac
done
if [ "${RINGLAB_JOIN_RAY:-0}" = "1" ]; then
  : "${RINGLAB_RAY_ADDRESS:?RINGLAB_JOIN_RAY=1 needs RINGLAB_RAY_ADDRESS (host:port of the Ray head)}"
  ray start --address="$RINGLAB_RAY_ADDRESS" --num-cpus=0 --num-gpus=0 \
    --object-store-memory="${RINGLAB_DRIVER_OBJECT_STORE_BYTES:-200000000}" --disable-usage-stats
fi
exec "$@"
