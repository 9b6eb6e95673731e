#!/usr/bin/env bash
# A small VM with two soft-RoCE devices (rdma_rxe), built from Debian packages only.
#
#   vm.sh prepare     fetch the stock kernel and rdma-core packages, build $W/vmlinuz and
#                     $W/initrd.gz (skipped when $W/ready matches this script; FERRY_RXE_REFRESH=1 rebuilds)
#   vm.sh run FILE    boot; share the host's / read-only; chroot into it and run the shell script
#                     FILE there (writable: /run, and /run/out = $W/out on the host). The script's
#                     exit code becomes ours; 99 means the guest never reported one. The guest's
#                     own root (with perftest) is at /run/vm.
#
# Inside the guest: veth0 <-> veth1, rxe0 on veth0 and rxe1 on veth1, GID 0 of each is the
# RoCE v2 link-local address. Host binaries run unchanged (same paths, the host's libibverbs
# and librxe), so tests built on the host are what runs against the devices.
#
# Env: W (work dir; default ~/.cache/ferry/rxe-vm), MEM (guest memory, default 4G),
# VM_TIMEOUT (seconds, default 1800), ACCEL (default TCG: /dev/kvm on these hosts is a PVM
# device that hangs a stock guest kernel).
set -euo pipefail
W=${W:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry/rxe-vm}
ACCEL=${ACCEL:--accel tcg,thread=multi -cpu max}
VM_TIMEOUT=${VM_TIMEOUT:-1800}
MEM=${MEM:-4G}
say() { echo "[rxe-vm $(date +%T)] $*" >&2; }

# Kernel modules to load, in dependency order (the guest has no modprobe). crc32_generic: rxe
# allocates the "crc32" hash when a device is added; without it `rdma link add` fails (ENOENT).
MODULES="drivers/infiniband/core/ib_core drivers/infiniband/core/ib_uverbs net/ipv4/udp_tunnel
  net/ipv6/ip6_udp_tunnel crypto/crc32_generic drivers/infiniband/sw/rxe/rdma_rxe drivers/net/veth
  drivers/virtio/virtio_ring drivers/virtio/virtio drivers/virtio/virtio_pci_modern_dev
  drivers/virtio/virtio_pci_legacy_dev drivers/virtio/virtio_pci
  fs/netfs/netfs fs/fscache/fscache net/9p/9pnet net/9p/9pnet_virtio fs/9p/9p"
# Guest tools (with their libraries): setting up links and devices, and perftest for baselines.
TOOLS="usr/bin/rdma bin/ip usr/bin/ibv_devinfo usr/bin/ib_write_lat usr/bin/ib_read_lat
  usr/bin/ib_send_lat usr/bin/ib_write_bw usr/bin/ib_read_bw
  usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so"

prepare() {
  # The image is rebuilt when this script changes (the guest's init is written from it).
  local recipe
  recipe=$(sha256sum "$0" | cut -c1-16)
  if [ -f "$W/ready" ] && grep -q "recipe $recipe" "$W/ready" && [ -z "${FERRY_RXE_REFRESH:-}" ]; then
    say "VM ready in $W ($(cat "$W/ready"))"
    return
  fi
  for tool in qemu-system-x86_64 cpio apt-get dpkg xz; do
    command -v $tool >/dev/null || { say "missing $tool (scripts/setup installs it)"; exit 1; }
  done
  rm -rf "$W" && mkdir -p "$W/debs" && cd "$W"
  apt-get update -qq
  local kernel
  kernel=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  [ -n "$kernel" ] || { say "cannot resolve linux-image-amd64 (run apt-get update)"; exit 1; }
  # apt-get download drops privileges to _apt: the directory must be writable by it.
  chmod 777 debs
  (cd debs && apt-get download -qq "$kernel" busybox-static libibverbs1 ibverbs-providers ibverbs-utils \
      perftest librdmacm1 libibumad3 libpci3 iproute2 libnl-3-200 libnl-route-3-200)
  mkdir kernel userland
  dpkg -x debs/"$kernel"_*.deb kernel
  for deb in debs/*.deb; do case $deb in *linux-image*) ;; *) dpkg -x "$deb" userland ;; esac; done
  local version root=$W/rootfs
  version=$(ls kernel/lib/modules)
  mkdir -p "$root"/{bin,sbin,usr/bin,lib/x86_64-linux-gnu,lib64,proc,sys,dev,tmp,run,out,host,modules} \
    "$root"/etc/libibverbs.d "$root"/usr/lib/x86_64-linux-gnu/libibverbs
  cp userland/bin/busybox "$root/bin/"
  for m in $MODULES; do
    local f
    f=$(ls kernel/lib/modules/"$version"/kernel/$m.ko* 2>/dev/null | head -1 || true)
    [ -n "$f" ] || { say "module $m not found (built into the kernel?)"; continue; }
    local name; name=$(basename "$m").ko
    case $f in
      *.xz) xz -dc "$f" >"$root/modules/$name" ;;
      *.zst) zstd -qdc "$f" >"$root/modules/$name" ;;
      *) cp "$f" "$root/modules/$name" ;;
    esac
    echo "$name" >>"$root/modules/order"
  done
  export LD_LIBRARY_PATH=$W/userland/usr/lib/x86_64-linux-gnu:$W/userland/lib/x86_64-linux-gnu
  for t in $TOOLS; do
    cp "userland/$t" "$root/$t"
    for lib in $(ldd "userland/$t" | awk '/=> \// {print $3}'); do cp -Ln "$lib" "$root/lib/x86_64-linux-gnu/"; done
  done
  mv "$root/bin/ip" "$root/sbin/ip"
  cp -L /lib64/ld-linux-x86-64.so.2 "$root/lib64/"
  cp -L /lib/x86_64-linux-gnu/libgcc_s.so.1 "$root/lib/x86_64-linux-gnu/"
  cp userland/etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
  printf '127.0.0.1 localhost\n::1 localhost\n' >"$root/etc/hosts"
  guest_init >"$root/init" && chmod +x "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 >"$W/initrd.gz")
  cp kernel/boot/vmlinuz-"$version" "$W/vmlinuz"
  rm -rf kernel userland debs rootfs
  echo "kernel $version, recipe $recipe" >"$W/ready"
  say "VM prepared in $W: kernel $version, initrd $(du -h "$W/initrd.gz" | cut -f1)"
}

# PID 1 of the guest: load modules, create the veth pair and the two rxe devices, mount the
# host, run the script, report its exit code through the shared directory, power off.
guest_init() {
  cat <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
for m in $(cat /modules/order); do insmod /modules/$m || echo "[guest] insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L out /out || echo "[guest] no /out share"
echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad      # link-local GID usable at once
echo 10000 > /proc/sys/net/core/netdev_max_backlog        # no veth drops under load
/sbin/ip link set lo up
/sbin/ip link add veth0 type veth peer name veth1
/sbin/ip link set veth0 up; /sbin/ip link set veth1 up
rdma link add rxe0 type rxe netdev veth0
rdma link add rxe1 type rxe netdev veth1
rdma link show
echo "[guest] rxe ready after $(cut -d' ' -f1 /proc/uptime) s"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose hostroot /host
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mount -t tmpfs run /host/run; mkdir -p /host/run/out /host/run/vm; mount --bind /out /host/run/out
mount --bind / /host/run/vm     # the guest's own tools (perftest) for same-run baselines
ulimit -l unlimited
chroot /host /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/run TMPDIR=/run \
    /bin/sh /run/out/script.sh; rc=$?
echo "[guest] script exit code $rc after $(cut -d' ' -f1 /proc/uptime) s"
echo $rc > /out/rc; sync; umount /host/run/out /out 2>/dev/null
poweroff -f
EOF
}

run() {
  local script=$1
  [ -f "$W/ready" ] || { say "the VM is not prepared (vm.sh prepare)"; exit 1; }
  rm -rf "$W/out" && mkdir -p "$W/out"
  cp "$script" "$W/out/script.sh"
  set +e
  timeout -k 10 "$VM_TIMEOUT" qemu-system-x86_64 $ACCEL -m "$MEM" -smp 2 -nographic -no-reboot -nic none \
    -kernel "$W/vmlinuz" -initrd "$W/initrd.gz" -append "console=ttyS0 quiet panic=-1" \
    -virtfs local,path="$W/out",mount_tag=out,security_model=none \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap |
    sed -u 's/\x1b\[[0-9;?]*[a-zA-Z]//g; s/\x1bc//g'
  local qemu=${PIPESTATUS[0]}
  set -e
  [ -f "$W/out/rc" ] || { say "the guest reported no exit code (qemu exit $qemu)"; return 99; }
  return "$(cat "$W/out/rc")"
}

case ${1:-} in
  prepare) prepare ;;
  run) [ $# -eq 2 ] || { echo "usage: $0 run SCRIPT" >&2; exit 2; }; run "$2" ;;
  *) echo "usage: $0 prepare | run SCRIPT" >&2; exit 2 ;;
esac
