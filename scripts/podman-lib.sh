# podman as it runs on this kind of machine (sourced by scripts/image*.sh): root, cgroups v1
# controllers beside a v2 mount, no systemd. Three defaults fail there, so:
#   - a containers.conf without default ulimits (setrlimit RLIMIT_NOFILE is refused);
#   - runc instead of crun ("cgroups in hybrid mode not supported");
#   - the cgroupfs cgroup manager instead of systemd.
# On a machine where podman works as installed, SECKILL_PODMAN_PLAIN=1 uses it as it is.
PODMAN_CONF="$HOME/.cache/seckill/podman/containers.conf"
if [[ "${SECKILL_PODMAN_PLAIN:-0}" != 1 ]]; then
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    echo "podman: installing podman and runc (apt)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc >/dev/null
  fi
  mkdir -p "$(dirname "$PODMAN_CONF")"
  printf '[containers]\ndefault_ulimits = []\n' >"$PODMAN_CONF"
fi
podman_() {
  if [[ "${SECKILL_PODMAN_PLAIN:-0}" == 1 ]]; then
    podman "$@"
  else
    CONTAINERS_CONF="$PODMAN_CONF" podman --runtime runc --cgroup-manager=cgroupfs "$@"
  fi
}
