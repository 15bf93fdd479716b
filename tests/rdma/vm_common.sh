# vm_common.sh - sourced by rxe_vm.sh and cluster.sh: checks the host's tools, picks the guest kernel (and its
# uncompressed vmlinux for a PVH boot), the accelerator, and builds the cached initramfs. The caller defines
# log, die and WORKDIR; this sets KERNEL, KVER, ACCEL, ACCEL_ARGS and INITRD. Knobs: RXE_VM_KERNEL, RXE_VM_KVER,
# RXE_VM_PVH, RXE_VM_ACCEL, RXE_VM_TCG_THREAD (rxe_vm.sh's header says what they do).
# The initramfs mounts the host's / read-only over 9p (tag hostroot) and the run's control dir (tag rxevmctl)
# at /run/rxe-vm, applies its mounts.sh (OVERLAYS) and rw.list, then runs /run/rxe-vm/stage2.sh as PID 1.
[ "$(id -u)" = 0 ] || die "must run as root"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (apt-get install qemu-system-x86)"
BUSYBOX=
for b in /bin/busybox /usr/bin/busybox $(command -v busybox || true); do
  if [ -x "$b" ] && case "$(LC_ALL=C ldd "$b" 2>&1)" in *'not a dynamic'*|*'statically linked'*) true ;; *) false ;; esac; then BUSYBOX=$b; break; fi
done
[ -n "$BUSYBOX" ] || die "static busybox missing (apt-get install busybox-static)"
command -v cpio >/dev/null || die "cpio missing (apt-get install cpio)"
command -v modprobe >/dev/null || die "modprobe missing (apt-get install kmod)"

# ---------------------------------------------------------------- kernel
if [ -n "${RXE_VM_KERNEL:-}" ]; then
  KERNEL=$RXE_VM_KERNEL
  KVER=${RXE_VM_KVER:-$(basename "$KERNEL" | sed 's/^vmlinuz-//')}
else
  KERNEL=
  for k in $(ls -1v /boot/vmlinuz-* 2>/dev/null | tac); do
    v=${k#/boot/vmlinuz-}
    if [ -n "$(find /lib/modules/"$v" -name 'rdma_rxe.ko*' 2>/dev/null | head -1)" ]; then
      KERNEL=$k; KVER=$v; break
    fi
  done
  [ -n "$KERNEL" ] || die "no /boot/vmlinuz-* with rdma_rxe.ko found (apt-get install linux-image-amd64)"
fi
[ -r "$KERNEL" ] || die "kernel $KERNEL not readable"
[ -d "/lib/modules/$KVER" ] || die "/lib/modules/$KVER missing"
log "kernel $KERNEL ($KVER)"

# ---------------------------------------------------------------- PVH fast path
# Booting the uncompressed vmlinux through its PVH entry point skips the
# in-guest kernel decompression, which under TCG costs ~3 s per boot.
if [ "${RXE_VM_PVH:-1}" = 1 ] && [ -z "${RXE_VM_KERNEL:-}" ] \
   && grep -q '^CONFIG_PVH=y' "/boot/config-$KVER" 2>/dev/null; then
  VMLINUX="$WORKDIR/cache/vmlinux-$KVER"
  if [ ! -s "$VMLINUX" ] && [ ! -e "$VMLINUX.failed" ]; then
    mkdir -p "$WORKDIR/cache"
    VTMP=$(mktemp "$VMLINUX.XXXXXX")
    for spec in 'fd377a585a00:xz -dcq' '28b52ffd:zstd -dcq' '1f8b08:gzip -dcq' '02214c18:lz4 -dcq'; do
      hex=${spec%%:*}; tool=${spec#*:}
      command -v "${tool%% *}" >/dev/null || continue
      pat=$(echo "$hex" | sed 's/../\\x&/g')
      for off in $(LC_ALL=C grep -obUaP "$pat" "$KERNEL" 2>/dev/null | cut -d: -f1 | head -5); do
        tail -c +$((off + 1)) "$KERNEL" | $tool > "$VTMP" 2>/dev/null || true
        if [ "$(head -c 4 "$VTMP" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
          chmod 644 "$VTMP"; mv "$VTMP" "$VMLINUX"; break 2
        fi
      done
    done
    rm -f "$VTMP"
    [ -s "$VMLINUX" ] || touch "$VMLINUX.failed"
  fi
  if [ -s "$VMLINUX" ]; then KERNEL=$VMLINUX; log "using uncompressed $VMLINUX (PVH boot)"; fi
fi

# ---------------------------------------------------------------- accel
ACCEL=${RXE_VM_ACCEL:-auto}
if [ "$ACCEL" = auto ]; then
  if [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ]; then ACCEL=kvm; else ACCEL=tcg; fi
fi
if [ "$ACCEL" = kvm ]; then
  ACCEL_ARGS=(-accel kvm -cpu host)
else
  # kvm_pvm hosts (paravirtual KVM inside a microVM) can only run PVM-enabled
  # guest kernels; a stock kernel there is instruction-emulated and dies
  # ("KVM internal error ... emulation failure"), so use TCG.
  # thread=multi (one host thread per vCPU) is best when the host cores are
  # free: ib_write_lat ~10 us. If other CPU-heavy processes share the host,
  # thread=single was 4-7x faster for fork/exec, but busy-polling peers then
  # see ~4 ms round trips (vCPUs are time-sliced on one thread).
  ACCEL_ARGS=(-accel "tcg,thread=${RXE_VM_TCG_THREAD:-multi},tb-size=256" -cpu max)
fi

# ---------------------------------------------------------------- initramfs (cached)
mkdir -p "$WORKDIR/cache" "$WORKDIR/runs"
INITRD_VERSION=4
INITRD="$WORKDIR/cache/initramfs-$KVER-v$INITRD_VERSION.cpio.gz"
if [ ! -s "$INITRD" ]; then
  log "building $INITRD"
  B=$(mktemp -d "$WORKDIR/cache/build.XXXXXX")
  mkdir -p "$B"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,newroot,mods}
  cp "$BUSYBOX" "$B/bin/busybox"
  : > "$B/mods/order"
  for m in virtio_pci virtio_mmio 9pnet_virtio 9p overlay; do
    modprobe -S "$KVER" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}' || true
  done | awk '!seen[$0]++' | while read -r ko; do
    n=$(basename "$ko")
    case "$ko" in
      *.ko.xz)  xz -dc "$ko" > "$B/mods/${n%.xz}"; n=${n%.xz} ;;
      *.ko.zst) zstd -qdc "$ko" > "$B/mods/${n%.zst}"; n=${n%.zst} ;;
      *.ko.gz)  gzip -dc "$ko" > "$B/mods/${n%.gz}"; n=${n%.gz} ;;
      *)        cp "$ko" "$B/mods/$n" ;;
    esac
    echo "$n" >> "$B/mods/order"
  done
  cat > "$B/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc; mount -t sysfs sysfs /sys; mount -t devtmpfs devtmpfs /dev
fail() { echo "rxe-vm init: $*"; echo o > /proc/sysrq-trigger; sleep 10; }
for m in $(cat /mods/order); do insmod /mods/$m 2>/dev/null; done
i=0
until mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot; do
  i=$((i+1)); [ $i -ge 50 ] && fail "cannot mount host root over 9p"; sleep 0.1
done
R=/newroot
mount -t tmpfs -o mode=1777 tmpfs $R/tmp
mount -t tmpfs -o mode=755 tmpfs $R/run
mkdir -p $R/run/rxe-vm
mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=512000,cache=none rxevmctl $R/run/rxe-vm || fail "cannot mount control dir"
. $R/run/rxe-vm/mounts.sh   # defines OVERLAYS; rw.list has "tag path" lines
for d in $OVERLAYS; do
  [ -d "$R$d" ] || continue
  n=$(echo "$d" | tr / _)
  mkdir -p $R/run/.ovl/$n/u $R/run/.ovl/$n/w
  mount -t overlay overlay -o lowerdir=$R$d,upperdir=$R/run/.ovl/$n/u,workdir=$R/run/.ovl/$n/w $R$d \
    || echo "rxe-vm init: overlay on $d failed (left read-only)"
done
while read -r tag p; do
  [ -n "$tag" ] || continue
  mkdir -p "$R$p" 2>/dev/null
  mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=512000,cache=mmap "$tag" "$R$p" \
    || fail "cannot mount rw dir $p"
done < $R/run/rxe-vm/rw.list
mount --move /proc $R/proc; mount --move /sys $R/sys; mount --move /dev $R/dev
exec switch_root $R /bin/bash /run/rxe-vm/stage2.sh
EOF
  chmod +x "$B/init"
  (cd "$B" && find . | cpio -o -H newc --quiet | gzip -1) > "$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"
  rm -rf "$B"
fi

