#!/bin/busybox sh
# /init of the blkplane guest test: PID 1 of the initramfs that build-initramfs.py makes. It
# checks the blkplane disks QEMU attached (vhost-user-blk-pci) and reports on the second serial
# port (/dev/ttyS1), one line per check, which tests/tests/guest.rs parses:
#
#   BLKPLANE-INFO <key> <text>           facts for the log (versions, disks)
#   BLKPLANE-BOOT <n>                    this is boot n (1, or 2 after the reboot)
#   BLKPLANE-CHECK ok <name> <detail>    a check passed
#   BLKPLANE-CHECK fail <name> <detail>  a check failed
#   BLKPLANE-HOST <action>               the host is to act now (crash-frontend: kill -9 of the
#                                        read-write disk's frontend and a restart;
#                                        crash-iothread: kill -9 of one of its iothreads;
#                                        drain: drain it with flush, check that nothing
#                                        completes or changes in the image, resume)
#                                        migrate-blocked: an attempt to live-migrate the VM
#                                        while the disk has a migration blocker, which must
#                                        fail; migrate: a live migration to a second QEMU,
#                                        after which the host writes the "migrated" marker;
#                                        hotplug: attach a second disk (bp.hp_serial) to the
#                                        running VM; unplug: detach it again)
#   BLKPLANE-REBOOT                      boot 1 passed and reboots (reboot -f, same QEMU)
#   BLKPLANE-DONE failed=<n> boot=<n>    nothing more follows; the guest powers off
#
# Every line also goes to the console (ttyS0), between the commands' own output, so the console
# log reads as a transcript. Expectations come from the kernel command line (bp.*=...).
# bp.mode=migrate (tests/tests/migration.rs) runs the live-migration phases on the read-write
# disk alone instead of the checks below (see migration_run).
# bp.mode=soak (tests/tests/soak.rs) runs fio write+verify rounds on two read-write disks
# (bp.serial and bp.serial2) while the host injects faults, until the host writes the stop
# marker (see soak_run).
# bp.mode=libvirt (tests/tests/libvirt.rs) checks the read-write disk of a libvirt domain, a disk
# the host hot-plugs and unplugs (bp.hp_serial, bp.hp_size), and a kill -9 of the first disk's
# frontend (see libvirt_run).
#
# Layout of the read-write disk (MiB):
#   [0, 96)     ext4 (mkfs.ext4 with a 96M file-system size on the whole disk)
#   [96, 128)   fio rand4k: 4k random writes, two jobs of 16 MiB
#   [128, 160)  fio seq128k: 128k sequential writes, two jobs of 16 MiB
#   [160, 164)  discard
#   [164, 168)  write-zeroes with unmap and no fallback (fallocate --punch-hole)
#   [168, 172)  write-zeroes (BLKZEROOUT: blkdiscard --zeroout)
#   [172, 176)  flush scratch
#   [176, 192)  fio mixed: time-based random read/write, two jobs of 8 MiB; then reused by
#               the crash phases (fio crash: 4k random write + verify, two jobs of 8 MiB)
#   200         the boot marker (one sector): "BLKPLANE-MARK stage1 <nonce> <manifest sha256>"
#               written at the end of boot 1, "... stage2 <nonce>" at the end of boot 2
#   201         the migrated marker (one sector): "BLKPLANE-MIGRATED <nonce>", written by the
#               host once the VM runs on the destination (bp.mode=migrate)
#   202         the freeze marker: "BLKPLANE-FREEZE <nonce>", written by the host once the
#               migration's first pass has sent every page (bp.mode=migrate)
#   [0, 96)     bp.mode=migrate: ext4 with cache.bin, random data read into the page cache
#               during the migration (see cache_filler)
#   203         the stop marker (one sector, bp.mode=soak): "BLKPLANE-STOP <nonce> <size>",
#               written by the host when its fault loop is over; size: the capacity in bytes
#               the second disk must have by then (the host grew it during the run)

/bin/busybox mkdir -p /proc /sys /dev /tmp /mnt /run /bin /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export LD_LIBRARY_PATH=/lib/x86_64-linux-gnu
export HOME=/root
umask 022
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
. /etc/blkplane/tools.env
cd /tmp || true

MIB=1048576
EXT4_MIB=96
DISCARD_MIB=160
PUNCH_MIB=164
ZEROOUT_MIB=168
FLUSH_MIB=172
MARK_SECTOR=$((200 * 2048))
MIGRATED_SECTOR=$((201 * 2048))
FREEZE_SECTOR=$((202 * 2048))
STOP_SECTOR=$((203 * 2048))
CACHE_MIB=48
REGION_MIB=4

FAILED=0
BOOT=0
START=$(date +%s)

# The results channel. Without it the host sees nothing and times out; say so on the console.
if ! exec 3>/dev/ttyS1; then
    echo "BLKPLANE: cannot open /dev/ttyS1; reporting on the console only"
    exec 3>/dev/console
fi
stty -F /dev/ttyS1 raw -echo 2>/dev/null

one_line() { printf '%s' "$*" | tr '\n\r\t' '   ' | cut -c1-400; }
emit() {
    local line
    line=$(one_line "$*")
    echo "$line" >&3
    echo "$line"
}
ok() { local name=$1; shift; emit "BLKPLANE-CHECK ok $name $*"; }
fail() { local name=$1; shift; emit "BLKPLANE-CHECK fail $name $*"; FAILED=$((FAILED + 1)); }
# verdict STATUS NAME DETAIL: ok if STATUS (the $? of the condition just tested) is 0.
verdict() {
    local st=$1; shift
    if [ "$st" = 0 ]; then ok "$@"; else fail "$@"; fi
}
finish() {
    emit "BLKPLANE-DONE failed=$FAILED boot=$BOOT elapsed=$(($(date +%s) - START))s"
    sync
    poweroff -f
    # Not reached unless poweroff failed; never let PID 1 exit (that panics the kernel).
    while true; do sleep 3600; done
}

param() {
    for w in $(cat /proc/cmdline); do
        case "$w" in "$1="*) echo "${w#*=}"; return 0 ;; esac
    done
    return 1
}
NONCE=$(param bp.nonce)
EXP_SIZE=$(param bp.size)
EXP_SERIAL=$(param bp.serial)
EXP_QUEUES=$(param bp.queues)
EXP_LBS=$(param bp.lbs)
EXP_RO_SIZE=$(param bp.ro_size)
EXP_RO_SERIAL=$(param bp.ro_serial)
MODE=$(param bp.mode) || MODE=checks
EXP_RO_SHA=$(param bp.ro_sha256)
NCPUS=$(grep -c ^processor /proc/cpuinfo)

# verify.fio pins its two jobs one per vCPU (cpus_allowed=0-1), which fio refuses outright on a
# guest with one vCPU (the libvirt test's); there both jobs share the one.
JOBFILE=/etc/blkplane/verify.fio
if [ "$NCPUS" -lt 2 ]; then
    sed '/^cpus_allowed/d' /etc/blkplane/verify.fio >/tmp/verify.fio
    JOBFILE=/tmp/verify.fio
fi

emit "BLKPLANE-INFO versions $(cat /etc/blkplane/versions)"
emit "BLKPLANE-INFO guest cpus=$NCPUS mem=$(grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2)kB"

# ---- helpers ---------------------------------------------------------------------------------

# Field n (1-based) of /sys/block/DEV/stat: 12 = discards completed, 16 = flushes completed.
stat_field() { tr -s ' ' <"/sys/block/$1/stat" | sed 's/^ //' | cut -d' ' -f"$2"; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# sha256 of COUNT MiB of DEV at MiB offset SKIP, read past the page cache.
hash_mib() {
    blockdev --flushbufs "/dev/$1" 2>/dev/null
    dd if="/dev/$1" bs=$MIB skip="$2" count="$3" 2>/dev/null | sha256sum | cut -d' ' -f1
}
zero_hash() { dd if=/dev/zero bs=$MIB count="$1" 2>/dev/null | sha256sum | cut -d' ' -f1; }
fill_random() {
    dd if=/dev/urandom of="/dev/$1" bs=$MIB seek="$2" count="$3" iflag=fullblock \
        conv=notrunc,fsync 2>/dev/null
}
# Completion interrupts of request queue Q of disk DEV (its MSI-X vector virtioN-req.Q),
# summed over the CPUs.
queue_irqs() {
    vdev=$(basename "$(readlink -f "/sys/block/$1/device")")
    awk -v name="$vdev-req.$2" '
        NR == 1 { ncpu = NF; next }
        $NF == name { s = 0; for (i = 2; i <= ncpu + 1; i++) s += $i; print s; found = 1 }
        END { if (!found) print -1 }' /proc/interrupts
}
# fio NAME SECTION [fio args]: runs a section of verify.fio on the read-write disk.
FIO_DETAIL=""
run_fio() {
    fname=$1; section=$2; shift 2
    t0=$(date +%s)
    echo "---- fio $section $* ----"
    BP_DEV=/dev/$RW "$FIO" --section="$section" "$@" --output=/tmp/fio-"$fname".log \
        "$JOBFILE"
    rc=$?
    cat /tmp/fio-"$fname".log
    bw=$(grep -E '^ *(READ|WRITE): ' /tmp/fio-"$fname".log \
        | sed -E 's/^ *(READ|WRITE): bw=([^ ]+) .* io=([^ ]+) .*/\1 \3 at \2/' | tr '\n' ';' \
        | sed 's/;$//; s/;/, /g')
    FIO_DETAIL="$(($(date +%s) - t0))s $bw"
    return $rc
}

# ---- devices ---------------------------------------------------------------------------------

loaded=""
for m in $(cat /etc/blkplane/modules); do
    if insmod "$m"; then
        loaded="$loaded $(basename "$m" .ko)"
    else
        fail modules "insmod $m failed"
    fi
done
[ "$FAILED" = 0 ] && emit "BLKPLANE-INFO modules$loaded"

# bp.shell on the command line (tests/guest/run-qemu.sh --shell): an interactive shell on the
# console instead of the checks; the guest powers off when it exits.
if param bp.shell >/dev/null; then
    echo "blkplane guest: shell on the console; the tools: $(tr '\n' ' ' </etc/blkplane/tools.env)"
    echo "blkplane guest: fio job file /etc/blkplane/verify.fio (BP_DEV=/dev/vdX fio --section=...)"
    setsid cttyhack sh -l || sh </dev/console >/dev/console 2>&1
    poweroff -f
fi

# Both disks, told apart by serial (GET_ID answered by the blkplane frontend).
RW=""
RO=""
i=0
while [ $i -lt 60 ]; do
    RW=""
    RO=""
    for d in /sys/block/vd*; do
        [ -e "$d/serial" ] || continue
        s=$(cat "$d/serial" 2>/dev/null)
        if [ "$s" = "$EXP_SERIAL" ]; then RW=${d##*/}; fi
        if [ "$s" = "$EXP_RO_SERIAL" ]; then RO=${d##*/}; fi
    done
    # Without bp.ro_serial there is no read-only disk to wait for.
    [ -n "$RW" ] && [ -b "/dev/$RW" ] && { [ -z "$EXP_RO_SERIAL" ] || [ -b "/dev/$RO" ]; } && break
    sleep 1
    i=$((i + 1))
done
if [ -z "$RW" ] || { [ -n "$EXP_RO_SERIAL" ] && [ -z "$RO" ]; }; then
    found=""
    for d in /sys/block/*; do found="$found ${d##*/}:serial=$(cat "$d/serial" 2>/dev/null)"; done
    fail disks "want serials $EXP_SERIAL and $EXP_RO_SERIAL, have:$found"
    finish
fi

marker=$(dd if="/dev/$RW" bs=512 skip=$MARK_SECTOR count=1 2>/dev/null | tr -d '\000' | head -n1)
set -- $marker
if [ "$1" = BLKPLANE-MARK ] && [ "$2" = stage1 ] && [ "$3" = "$NONCE" ]; then
    BOOT=2
    P=reboot-
    MARKER_MANIFEST=$4
else
    BOOT=1
    P=""
fi
emit "BLKPLANE-BOOT $BOOT"
ok "${P}disks" "read-write $RW, read-only ${RO:-none} (by serial)"

# ---- what the guest sees: capacity, serial, queues, read-only flag ---------------------------

identity() {
    dev=$1 want_size=$2 want_serial=$3 want_queues=$4 want_ro=$5 tag=$6
    size=$(($(cat "/sys/block/$dev/size") * 512))
    size64=$(blockdev --getsize64 "/dev/$dev")
    lbs=$(cat "/sys/block/$dev/queue/logical_block_size")
    [ "$size" = "$want_size" ] && [ "$size64" = "$want_size" ] && [ "$lbs" = "$EXP_LBS" ]
    verdict $? "${P}${tag}capacity" "$dev size=$size getsize64=$size64 lbs=$lbs want size=$want_size lbs=$EXP_LBS"
    serial=$(cat "/sys/block/$dev/serial")
    [ "$serial" = "$want_serial" ]
    verdict $? "${P}${tag}serial" "$dev serial=$serial want $want_serial"
    queues=$(ls "/sys/block/$dev/mq" | wc -l)
    qlist=$(ls "/sys/block/$dev/mq" | tr '\n' ' ')
    [ "$queues" = "$want_queues" ]
    verdict $? "${P}${tag}queues" "$dev blk-mq queues=$queues ($qlist) want $want_queues"
    ro=$(cat "/sys/block/$dev/ro")
    getro=$(blockdev --getro "/dev/$dev")
    [ "$ro" = "$want_ro" ] && [ "$getro" = "$want_ro" ]
    verdict $? "${P}${tag}ro-flag" "$dev sysfs ro=$ro blockdev --getro=$getro want $want_ro"
}
identity "$RW" "$EXP_SIZE" "$EXP_SERIAL" "$EXP_QUEUES" 0 ""
[ -n "$RO" ] && identity "$RO" "$EXP_RO_SIZE" "$EXP_RO_SERIAL" 1 1 "ro-disk-"

# ---- the read-only disk: its data, and writes refused -----------------------------------------

ro_disk() {
    mib=$((EXP_RO_SIZE / MIB))
    h=$(hash_mib "$RO" 0 "$mib")
    [ "$h" = "$EXP_RO_SHA" ]
    verdict $? "${P}ro-disk-read" "sha256 of $mib MiB $h want $EXP_RO_SHA"
    [ "$BOOT" = 1 ] || return 0
    if dd if=/dev/zero of="/dev/$RO" bs=4096 count=1 conv=notrunc,fsync 2>/tmp/ro-dd.err; then
        fail ro-disk-write-refused "a 4 KiB write to /dev/$RO succeeded"
    else
        ok ro-disk-write-refused "$(grep -v records /tmp/ro-dd.err | tail -n1)"
    fi
    if "$BLKDISCARD" -f -o 0 -l $MIB "/dev/$RO" 2>/tmp/ro-discard.err; then
        fail ro-disk-discard-refused "blkdiscard on /dev/$RO succeeded"
    else
        ok ro-disk-discard-refused "$(tail -n1 /tmp/ro-discard.err)"
    fi
    h2=$(hash_mib "$RO" 0 "$mib")
    [ "$h2" = "$EXP_RO_SHA" ]
    verdict $? ro-disk-unchanged "sha256 after the refused writes $h2"
}
[ -n "$RO" ] && ro_disk

# ---- boot 1: fio write + verify on both queues, re-read verify ---------------------------------

fio_checks() {
    irq0_before=$(queue_irqs "$RW" 0)
    irq1_before=$(queue_irqs "$RW" 1)
    for job in rand4k seq128k; do
        if run_fio "$job" "$job"; then ok "fio-$job" "write+verify crc32c, 2 jobs iodepth 16: $FIO_DETAIL"
        else fail "fio-$job" "fio exit $rc: $FIO_DETAIL $(grep -iE 'verify|error|bad' /tmp/fio-$job.log | head -n3)"; fi
    done
    irq0=$(($(queue_irqs "$RW" 0) - irq0_before))
    irq1=$(($(queue_irqs "$RW" 1) - irq1_before))
    cpus0=$(cat "/sys/block/$RW/mq/0/cpu_list" 2>/dev/null)
    cpus1=$(cat "/sys/block/$RW/mq/1/cpu_list" 2>/dev/null)
    [ "$irq0" -gt 0 ] && [ "$irq1" -gt 0 ]
    verdict $? mq-both-queues "completion interrupts during fio: req.0 +$irq0 (cpus $cpus0), req.1 +$irq1 (cpus $cpus1)"
    if run_fio mixed mixed; then ok fio-mixed "time-based randrw, verify_backlog: $FIO_DETAIL"
    else fail fio-mixed "fio exit $rc: $FIO_DETAIL $(grep -iE 'verify|error|bad' /tmp/fio-mixed.log | head -n3)"; fi
}

reverify() {
    prefix=$1
    for job in rand4k seq128k; do
        if run_fio "verify-$job" "$job" --verify_only; then ok "${prefix}verify-$job" "verify_only re-read: $FIO_DETAIL"
        else fail "${prefix}verify-$job" "fio exit $rc: $FIO_DETAIL $(grep -iE 'verify|error|bad' /tmp/fio-verify-$job.log | head -n3)"; fi
    done
}

# ---- crash-safe reconnect: kill -9 of a blkplane process during fio write+verify ---------------

# Kernel log lines that mean the guest saw a failed request.
io_errors() { dmesg | grep -cE "I/O error|critical (medium|target|nexus|space) error|Buffer I/O error"; }

# crash_phase ACTION: fio write+verify on the crash region; once its writes flow, the host is
# asked (BLKPLANE-HOST ACTION) to kill a blkplane process during them. The requests that were
# in flight must be resubmitted: fio must finish without an error and verify every block, and
# the kernel must log no I/O error.
# wait_writes_flow PID W0: waits (at most a minute) until fio PID is past its start-up and
# writing: 200 writes completed (stat field 5) since the count was W0.
wait_writes_flow() {
    i=0
    while [ $i -lt 600 ] && kill -0 "$1" 2>/dev/null; do
        [ $(($(stat_field "$RW" 5) - $2)) -ge 200 ] && break
        sleep 0.1
        i=$((i + 1))
    done
}

crash_phase() {
    action=$1
    e0=$(io_errors)
    w0=$(stat_field "$RW" 5)
    t0=$(date +%s)
    echo "---- fio crash ($action) ----"
    BP_DEV=/dev/$RW "$FIO" --section=crash --output=/tmp/fio-"$action".log \
        "$JOBFILE" &
    fio_pid=$!
    wait_writes_flow $fio_pid "$w0"
    emit "BLKPLANE-HOST $action"
    wait $fio_pid
    rc=$?
    cat /tmp/fio-"$action".log
    e1=$(io_errors)
    bw=$(grep -E '^ *(READ|WRITE): ' /tmp/fio-"$action".log \
        | sed -E 's/^ *(READ|WRITE): bw=([^ ]+) .* io=([^ ]+) .*/\1 \3 at \2/' | tr '\n' ';' \
        | sed 's/;$//; s/;/, /g')
    # fio exits 0 when it refuses to start: it must have written and read.
    [ "$rc" = 0 ] && [ "$e1" = "$e0" ] && grep -q '^ *WRITE: ' /tmp/fio-"$action".log \
        && grep -q '^ *READ: ' /tmp/fio-"$action".log
    verdict $? "$action" "fio write+verify across the host action: exit $rc in $(($(date +%s) - t0))s, $bw; kernel I/O errors $e0 -> $e1 $(dmesg | grep -E 'I/O error' | tail -n1)"
}

# ---- ext4 -------------------------------------------------------------------------------------

MANIFEST_SHA=""
ext4_checks() {
    if "$MKE2FS" -F -q -t ext4 "/dev/$RW" ${EXT4_MIB}M </dev/null >/tmp/mkfs.log 2>&1 \
        && mount -t ext4 "/dev/$RW" /mnt; then
        ok ext4-mkfs-mount "mkfs.ext4 ${EXT4_MIB}M on /dev/$RW, mounted"
    else
        fail ext4-mkfs-mount "$(cat /tmp/mkfs.log)"
        return
    fi
    t0=$(date +%s)
    n=0
    total=0
    mkdir -p /mnt/d/e
    for sz in 0 1 511 4096 65537 1048576 3000000 8388608 200000 12345; do
        for dir in /mnt /mnt/d/e; do
            head -c "$sz" /dev/urandom >"$dir/f$n" || fail ext4-write "writing $dir/f$n"
            n=$((n + 1))
            total=$((total + sz))
        done
    done
    (cd /mnt && find . -type f | sort | xargs sha256sum) >/tmp/manifest
    cp /tmp/manifest /mnt/MANIFEST
    sync
    MANIFEST_SHA=$(sha256sum </tmp/manifest | cut -d' ' -f1)
    if umount /mnt; then
        ok ext4-write "$n files, $total bytes, sha256 manifest $MANIFEST_SHA, sync, umount in $(($(date +%s) - t0))s"
    else
        fail ext4-write "umount failed"
        return
    fi
    drop_caches
    if "$E2FSCK" -fn "/dev/$RW" >/tmp/fsck.log 2>&1; then
        ok e2fsck "e2fsck -fn clean: $(tail -n1 /tmp/fsck.log)"
    else
        fail e2fsck "e2fsck -fn exit $?: $(tail -n5 /tmp/fsck.log)"
    fi
    cat /tmp/fsck.log
    drop_caches
    if mount -t ext4 -o ro "/dev/$RW" /mnt && (cd /mnt && sha256sum -c -s MANIFEST) \
        && cmp -s /mnt/MANIFEST /tmp/manifest; then
        ok ext4-remount "remounted read-only, all $n sha256 match"
    else
        fail ext4-remount "checksums differ after remount: $(cd /mnt && sha256sum -c MANIFEST 2>&1 | grep -v ': OK' | head -n3)"
    fi
    umount /mnt
}

ext4_after_reboot() {
    if "$E2FSCK" -fn "/dev/$RW" >/tmp/fsck.log 2>&1; then
        ok reboot-e2fsck "e2fsck -fn clean: $(tail -n1 /tmp/fsck.log)"
    else
        fail reboot-e2fsck "e2fsck -fn exit $?: $(tail -n5 /tmp/fsck.log)"
    fi
    if ! mount -t ext4 -o ro "/dev/$RW" /mnt; then
        fail reboot-ext4-files "mount failed"
        return
    fi
    msha=$(sha256sum </mnt/MANIFEST | cut -d' ' -f1)
    n=$(wc -l </mnt/MANIFEST)
    if [ "$msha" = "$MARKER_MANIFEST" ] && (cd /mnt && sha256sum -c -s MANIFEST); then
        ok reboot-ext4-files "MANIFEST sha256 $msha as recorded before the reboot, all $n files match"
    else
        fail reboot-ext4-files "MANIFEST sha256 $msha, recorded $MARKER_MANIFEST: $(cd /mnt && sha256sum -c MANIFEST 2>&1 | grep -v ': OK' | head -n3)"
    fi
    umount /mnt
}

# ---- discard, write-zeroes, flush -------------------------------------------------------------

ZERO_HASH=$(zero_hash $REGION_MIB)

discard_checks() {
    q=/sys/block/$RW/queue
    fill_random "$RW" $DISCARD_MIB $REGION_MIB
    before=$(hash_mib "$RW" $DISCARD_MIB $REGION_MIB)
    d0=$(stat_field "$RW" 12)
    if "$BLKDISCARD" -f -o $((DISCARD_MIB * MIB)) -l $((REGION_MIB * MIB)) "/dev/$RW" 2>/tmp/discard.err; then
        d1=$(stat_field "$RW" 12)
        after=$(hash_mib "$RW" $DISCARD_MIB $REGION_MIB)
        [ "$before" != "$ZERO_HASH" ] && [ "$after" = "$ZERO_HASH" ] && [ "$d1" -gt "$d0" ]
        verdict $? discard "discard_max_bytes=$(cat $q/discard_max_bytes) discards +$((d1 - d0)), ${REGION_MIB} MiB at ${DISCARD_MIB}M read back as zeros"
    else
        fail discard "blkdiscard: $(cat /tmp/discard.err) discard_max_bytes=$(cat $q/discard_max_bytes)"
    fi

    # fallocate --punch-hole on a block device is REQ_OP_WRITE_ZEROES with unmap and no
    # fallback to writing zero pages: it fails unless the device does write-zeroes.
    fill_random "$RW" $PUNCH_MIB $REGION_MIB
    before=$(hash_mib "$RW" $PUNCH_MIB $REGION_MIB)
    if "$FALLOCATE" --punch-hole --offset $((PUNCH_MIB * MIB)) --length $((REGION_MIB * MIB)) "/dev/$RW" 2>/tmp/punch.err; then
        after=$(hash_mib "$RW" $PUNCH_MIB $REGION_MIB)
        [ "$before" != "$ZERO_HASH" ] && [ "$after" = "$ZERO_HASH" ]
        verdict $? write-zeroes-unmap "write_zeroes_max_bytes=$(cat $q/write_zeroes_max_bytes), fallocate --punch-hole ${REGION_MIB} MiB at ${PUNCH_MIB}M read back as zeros"
    else
        fail write-zeroes-unmap "fallocate --punch-hole: $(cat /tmp/punch.err) write_zeroes_max_bytes=$(cat $q/write_zeroes_max_bytes)"
    fi

    fill_random "$RW" $ZEROOUT_MIB $REGION_MIB
    before=$(hash_mib "$RW" $ZEROOUT_MIB $REGION_MIB)
    if "$BLKDISCARD" -f --zeroout -o $((ZEROOUT_MIB * MIB)) -l $((REGION_MIB * MIB)) "/dev/$RW" 2>/tmp/zeroout.err; then
        after=$(hash_mib "$RW" $ZEROOUT_MIB $REGION_MIB)
        [ "$before" != "$ZERO_HASH" ] && [ "$after" = "$ZERO_HASH" ]
        verdict $? write-zeroes "blkdiscard --zeroout ${REGION_MIB} MiB at ${ZEROOUT_MIB}M read back as zeros"
    else
        fail write-zeroes "blkdiscard --zeroout: $(cat /tmp/zeroout.err)"
    fi

    wc=$(cat $q/write_cache)
    f0=$(stat_field "$RW" 16)
    dd if=/dev/urandom of="/dev/$RW" bs=4096 seek=$((FLUSH_MIB * 256)) count=16 conv=notrunc,fsync 2>/dev/null
    rc=$?
    f1=$(stat_field "$RW" 16)
    [ "$rc" = 0 ] && [ "$wc" = "write back" ] && [ "$f1" -gt "$f0" ]
    verdict $? flush "write_cache=$wc, 64 KiB written + fsync: exit $rc, flushes completed $f0 -> $f1"
}

zeros_after_reboot() {
    a=$(hash_mib "$RW" $DISCARD_MIB $REGION_MIB)
    b=$(hash_mib "$RW" $PUNCH_MIB $REGION_MIB)
    c=$(hash_mib "$RW" $ZEROOUT_MIB $REGION_MIB)
    [ "$a" = "$ZERO_HASH" ] && [ "$b" = "$ZERO_HASH" ] && [ "$c" = "$ZERO_HASH" ]
    verdict $? reboot-zeros "discarded and zeroed regions still read as zeros"
}

write_marker() {
    printf '%s\n' "$1" | dd of="/dev/$RW" bs=512 seek=$MARK_SECTOR count=1 conv=sync,notrunc,fsync 2>/dev/null
    drop_caches
    got=$(dd if="/dev/$RW" bs=512 skip=$MARK_SECTOR count=1 2>/dev/null | tr -d '\000' | head -n1)
    [ "$got" = "$1" ]
}

# ---- live migration (bp.mode=migrate) ----------------------------------------------------------

# The text of the marker sector $1, read past the page cache (O_DIRECT: dropping the cache
# would also drop what cache_filler read).
marker_at() {
    dd if="/dev/$RW" bs=4096 skip=$(($1 / 8)) count=1 iflag=direct 2>/dev/null | tr -d '\000' | head -n1
}
# Whether the host has written the migrated marker (it does once the VM runs on the
# destination).
migrated() { [ "$(marker_at $MIGRATED_SECTOR)" = "BLKPLANE-MIGRATED $NONCE" ]; }

# Once the host writes the freeze marker — the migration's first pass has copied every page,
# free pages holding zeros (migration_run scrubbed them) — reads /mnt/cache.bin into the page
# cache: the device writes it straight into pages the migration already copied as zeros.
# They stay cached: on the destination they must hold the data, which only the source
# frontend's dirty log can have made the migration copy again. (A file's cache, not the
# disk's: fio flushes the whole block device's cache, BLKFLSBUF, when it starts.)
cache_filler() {
    n=0
    while [ $n -lt 1000 ]; do
        n=$((n + 1))
        if [ "$(marker_at $FREEZE_SECTOR)" = "BLKPLANE-FREEZE $NONCE" ]; then
            cat /mnt/cache.bin >/dev/null
            emit "BLKPLANE-INFO cache-filled"
            return 0
        fi
        sleep 0.2
    done
    return 1
}

# fio write+verify rounds (the crash section: every block written, then read back and checked)
# without a pause, from before the host starts the migration until one whole round after the
# guest sees the migrated marker, so the switch-over lands inside a round and the last round
# runs on the destination alone. Every round must pass, with no kernel I/O error.
migrate_phase() {
    e0=$(io_errors)
    w0=$(stat_field "$RW" 5)
    t0=$(date +%s)
    rounds=0 rc=0 seen=0 asked=0
    cache_filler &
    filler=$!
    # Keeps a few MiB of guest memory dirty at all times, so that the host's first pass
    # (no downtime allowed) cannot finish before it lets it: a guest that happens to dirty
    # nothing between two syncs would otherwise be switched over at once.
    ( while :; do dd if=/dev/zero of=/dev/null bs=4M count=16 2>/dev/null; done ) &
    dirtier=$!
    while [ $rounds -lt 60 ]; do
        rounds=$((rounds + 1))
        # cache.bin's ext4 is mounted on the disk's first 96 MiB; fio writes past it.
        BP_DEV=/dev/$RW "$FIO" --section=crash --allow_mounted_write=1 \
            --output=/tmp/fio-migrate.log "$JOBFILE" &
        fio_pid=$!
        if [ $asked = 0 ]; then
            wait_writes_flow $fio_pid "$w0"
            emit "BLKPLANE-HOST migrate"
            asked=1
        fi
        wait $fio_pid
        rc=$?
        # fio exits 0 when it refuses to start: a round counts only if it wrote and read.
        if [ "$rc" = 0 ] && ! { grep -q '^ *WRITE: ' /tmp/fio-migrate.log \
            && grep -q '^ *READ: ' /tmp/fio-migrate.log; }; then
            rc=no-io
        fi
        if [ "$rc" != 0 ]; then
            cat /tmp/fio-migrate.log
            break
        fi
        [ $seen = 1 ] && break
        migrated && seen=1 && emit "BLKPLANE-INFO migrated marker seen after round $rounds"
    done
    e1=$(io_errors)
    kill $dirtier 2>/dev/null
    wait $dirtier 2>/dev/null
    wait $filler
    filled=$?
    # Served from the page cache: the device reads (almost) nothing for it.
    r0=$(stat_field "$RW" 3)
    h=$(sha256sum </mnt/cache.bin | cut -d' ' -f1)
    dev_kib=$((($(stat_field "$RW" 3) - r0) / 2))
    [ "$filled" = 0 ] && [ "$h" = "$CACHE_SHA" ] && [ "$dev_kib" -lt 1024 ]
    verdict $? migrate-read-pages "$CACHE_MIB MiB the device read into the page cache after the migration's first pass, hashed from the cache on the destination (device read ${dev_kib} KiB for it): sha256 $h want $CACHE_SHA (filler exit $filled)"
    [ "$rc" = 0 ] && [ $seen = 1 ] && [ "$e1" = "$e0" ]
    verdict $? migrate "fio write+verify rounds across the live migration: $rounds rounds in $(($(date +%s) - t0))s, last exit $rc, marker seen $seen; kernel I/O errors $e0 -> $e1 $(dmesg | grep -E 'I/O error' | tail -n1)"
}

migration_run() {
    crash_phase migrate-blocked
    if ! "$MKE2FS" -F -q -t ext4 "/dev/$RW" ${EXT4_MIB}M </dev/null >/tmp/mkfs.log 2>&1 \
        || ! mount -t ext4 "/dev/$RW" /mnt; then
        fail migrate-read-pages "mkfs/mount: $(cat /tmp/mkfs.log)"
    fi
    head -c $((CACHE_MIB * MIB)) /dev/urandom >/mnt/cache.bin
    sync
    CACHE_SHA=$(sha256sum </mnt/cache.bin | cut -d' ' -f1)
    # No page may still hold the file's data when the migration copies it: drop the cache,
    # then zero most free memory (tmpfs pages, freed again).
    echo 3 >/proc/sys/vm/drop_caches
    dd if=/dev/zero of=/tmp/scrub bs=1M count=200 2>/dev/null
    rm -f /tmp/scrub
    migrate_phase
    if run_fio migrate-reverify crash --verify_only --allow_mounted_write=1 \
        && grep -q '^ *READ: ' /tmp/fio-migrate-reverify.log; then
        ok migrate-reverify "verify_only re-read on the destination: $FIO_DETAIL"
    else fail migrate-reverify "fio exit $rc: $FIO_DETAIL $(grep -iE 'verify|error|bad' /tmp/fio-migrate-reverify.log | head -n3)"; fi
    finish
}

# ---- soak (bp.mode=soak) -----------------------------------------------------------------------

# fio section $1 on /dev/$2 in the background, into /tmp/soak-$2.log; sets SOAK_PID.
soak_fio() {
    BP_DEV=/dev/$2 "$FIO" --section="$1" --output=/tmp/soak-"$2".log "$JOBFILE" &
    SOAK_PID=$!
}

# soak_result DEV RC: 0 if the fio run on DEV exited 0 and both wrote and read (fio exits 0
# when it refuses to start).
soak_result() {
    [ "$2" = 0 ] && grep -q '^ *WRITE: ' /tmp/soak-"$1".log && grep -q '^ *READ: ' /tmp/soak-"$1".log
}

# Rounds of fio on both disks at once — the crash section (4k random writes, then every block
# read back and checked) and the mixed one (time-based random read/write, verified as it goes)
# in turn — until the host's stop marker is on the first disk. The first round tells the host
# when writes flow (BLKPLANE-HOST soak-start); each round is reported (BLKPLANE-INFO
# soak-round). Every round must pass on both disks with no kernel I/O error, and the second
# disk must have the capacity the stop marker names (the host resized it live).
soak_run() {
    serial2=$(param bp.serial2)
    RW2=""
    for d in /sys/block/vd*; do
        [ "$(cat "$d/serial" 2>/dev/null)" = "$serial2" ] && RW2=${d##*/}
    done
    if [ -z "$RW2" ] || [ ! -b "/dev/$RW2" ]; then
        fail soak-disks "no disk with serial $serial2"
        finish
    fi
    ok soak-disks "$RW (serial $EXP_SERIAL) and $RW2 (serial $serial2)"
    e0=$(io_errors)
    w0=$(stat_field "$RW" 5)
    t0=$(date +%s)
    rounds=0 bad=0 seen=0
    while [ $seen = 0 ]; do
        rounds=$((rounds + 1))
        if [ $((rounds % 2)) = 1 ]; then section=crash; else section=mixed; fi
        r0=$(date +%s)
        soak_fio $section "$RW"
        pid1=$SOAK_PID
        soak_fio $section "$RW2"
        pid2=$SOAK_PID
        if [ $rounds = 1 ]; then
            wait_writes_flow $pid1 "$w0"
            emit "BLKPLANE-HOST soak-start"
        fi
        wait $pid1
        rc1=$?
        wait $pid2
        rc2=$?
        verdict1=ok verdict2=ok
        soak_result "$RW" $rc1 || verdict1=fail
        soak_result "$RW2" $rc2 || verdict2=fail
        for pair in "$RW:$verdict1:$rc1" "$RW2:$verdict2:$rc2"; do
            dev=${pair%%:*}
            rest=${pair#*:}
            if [ "${rest%%:*}" = fail ]; then
                bad=$((bad + 1))
                cat /tmp/soak-"$dev".log
                fail soak-round "round $rounds ($section) on $dev: fio exit ${rest#*:}: $(grep -iE 'verify|error|bad' /tmp/soak-"$dev".log | head -n3)"
            fi
        done
        emit "BLKPLANE-INFO soak-round $rounds $section $RW=$verdict1 $RW2=$verdict2 in $(($(date +%s) - r0))s, kernel I/O errors $(io_errors)"
        set -- $(marker_at $STOP_SECTOR)
        [ "$1" = BLKPLANE-STOP ] && [ "$2" = "$NONCE" ] && seen=1
    done
    want_size=$3
    e1=$(io_errors)
    [ $bad = 0 ] && [ $rounds -ge 2 ]
    verdict $? soak-io "$rounds fio write+verify rounds on $RW and $RW2 in $(($(date +%s) - t0))s, $bad failed"
    [ "$e1" = "$e0" ]
    verdict $? soak-kernel-errors "kernel I/O errors $e0 -> $e1 $(dmesg | grep -E 'I/O error' | tail -n1)"
    size=$(($(cat "/sys/block/$RW2/size") * 512))
    size64=$(blockdev --getsize64 "/dev/$RW2")
    [ "$size" = "$want_size" ] && [ "$size64" = "$want_size" ]
    verdict $? soak-resize "$RW2 size=$size getsize64=$size64 want $want_size ($(dmesg | grep -c 'new size') capacity changes in the kernel log)"
    finish
}

# ---- libvirt (bp.mode=libvirt) -----------------------------------------------------------------

# wait_serial SERIAL TENTHS: waits (at most TENTHS tenths of a second) for a disk with SERIAL
# and its device node; its name goes to HP.
wait_serial() {
    i=0
    while [ $i -lt "$2" ]; do
        for d in /sys/block/vd*; do
            if [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ] && [ -b "/dev/${d##*/}" ]; then
                HP=${d##*/}
                return 0
            fi
        done
        sleep 0.1
        i=$((i + 1))
    done
    return 1
}

# The host attaches a second disk (virsh attach-device) when asked; it must appear with its
# serial and capacity and pass fio write+verify; then the host detaches it (virsh
# detach-device) and the kernel must let it go, all without an I/O error on any disk.
hotplug_phase() {
    hp_serial=$(param bp.hp_serial)
    hp_size=$(param bp.hp_size)
    e0=$(io_errors)
    t0=$(date +%s)
    before=$(ls /sys/block | tr '\n' ' ')
    emit "BLKPLANE-HOST hotplug"
    if ! wait_serial "$hp_serial" 1800; then
        fail hotplug "no disk with serial $hp_serial within 180s of the request; before: $before now: $(ls /sys/block | tr '\n' ' ')"
        return
    fi
    size=$(($(cat "/sys/block/$HP/size") * 512))
    [ "$size" = "$hp_size" ]
    verdict $? hotplug "$HP (serial $hp_serial) appeared $(($(date +%s) - t0))s after the request, size=$size want $hp_size"
    t0=$(date +%s)
    echo "---- fio hotplug ----"
    BP_DEV=/dev/$HP "$FIO" --section=crash --output=/tmp/fio-hotplug.log "$JOBFILE"
    rc=$?
    cat /tmp/fio-hotplug.log
    bw=$(grep -E '^ *(READ|WRITE): ' /tmp/fio-hotplug.log \
        | sed -E 's/^ *(READ|WRITE): bw=([^ ]+) .* io=([^ ]+) .*/\1 \3 at \2/' | tr '\n' ';' \
        | sed 's/;$//; s/;/, /g')
    [ "$rc" = 0 ] && grep -q '^ *WRITE: ' /tmp/fio-hotplug.log && grep -q '^ *READ: ' /tmp/fio-hotplug.log
    verdict $? hotplug-fio "fio write+verify on $HP: exit $rc in $(($(date +%s) - t0))s, $bw"
    t0=$(date +%s)
    emit "BLKPLANE-HOST unplug"
    i=0
    while [ -e "/sys/block/$HP" ] && [ $i -lt 1800 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    e1=$(io_errors)
    [ ! -e "/sys/block/$HP" ] && [ "$e1" = "$e0" ]
    verdict $? hotplug-detach "$HP present=$([ -e "/sys/block/$HP" ] && echo yes || echo no) $(($(date +%s) - t0))s after the request; kernel I/O errors $e0 -> $e1 $(dmesg | grep -E 'I/O error' | tail -n1)"
}

# fio write+verify on the domain's disk, the hot-plugged disk, then fio write+verify while the
# host kills the disk's frontend (blkplaned restarts it, QEMU reconnects as libvirt's
# <reconnect> tells it).
libvirt_run() {
    if run_fio rand4k rand4k; then ok fio-rand4k "write+verify crc32c, 2 jobs iodepth 16: $FIO_DETAIL"
    else fail fio-rand4k "fio exit $rc: $FIO_DETAIL $(grep -iE 'verify|error|bad' /tmp/fio-rand4k.log | head -n3)"; fi
    hotplug_phase
    crash_phase crash-frontend
    finish
}

# ---- the run ----------------------------------------------------------------------------------

[ "$MODE" = migrate ] && migration_run
[ "$MODE" = soak ] && soak_run
[ "$MODE" = libvirt ] && libvirt_run

if [ "$BOOT" = 1 ]; then
    fio_checks
    reverify ""
    crash_phase crash-frontend
    crash_phase crash-iothread
    crash_phase drain
    ext4_checks
    discard_checks
    if [ "$FAILED" != 0 ]; then
        emit "BLKPLANE-INFO not rebooting: $FAILED checks failed"
        finish
    fi
    mark="BLKPLANE-MARK stage1 $NONCE $MANIFEST_SHA"
    if write_marker "$mark"; then
        ok marker "boot marker written at sector $MARK_SECTOR and read back"
    else
        fail marker "boot marker did not read back"
        finish
    fi
    emit "BLKPLANE-REBOOT"
    sync
    reboot -f
    fail reboot "reboot -f returned"
    finish
else
    ok reboot-marker "found the boot-1 marker ($NONCE) after reboot -f"
    reverify reboot-
    ext4_after_reboot
    zeros_after_reboot
    if write_marker "BLKPLANE-MARK stage2 $NONCE"; then
        ok reboot-marker-written "boot-2 marker written"
    else
        fail reboot-marker-written "boot-2 marker did not read back"
    fi
    finish
fi
