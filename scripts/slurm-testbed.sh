#!/usr/bin/env bash
# A real Slurm on one machine, for the tests of the Slurm recipes (docs/cluster.md):
# Debian's slurm-wlm, one slurmctld and N slurmd, each slurmd a "node" of its own: a network
# namespace behind a veth on a bridge (its own address and host name), a private /dev/shm
# (its node-local memory), a private /mnt/nvme (its local disk) and its own /etc/hosts naming
# every node. Jobs are submitted here
# with sbatch/srun as on a cluster's login node; the shared file system is this machine's
# (/tmp, /work, the test PFS).
#
#   slurm-testbed.sh start [N] [--shm SIZE]   N nodes n1..nN (default 4; /dev/shm 512m each)
#   slurm-testbed.sh stop
#   slurm-testbed.sh status
#   eval "$(slurm-testbed.sh env)"            SLURM_CONF for sbatch/srun/squeue
#
# Needs root (namespaces, the bridge, munged). State lives under $SLURM_TESTBED (default
# /tmp/stagefs-slurm).
set -euo pipefail
STATE=${SLURM_TESTBED:-/tmp/stagefs-slurm}
BR=sfsbr0 NET=10.78.0
CONF=$STATE/slurm.conf

need_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 >/dev/null
}

start_munge() {
  [[ -S /run/munge/munge.socket.2 ]] && munge -n >/dev/null 2>&1 && return
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  [[ -f /etc/munge/munge.key ]] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && return; sleep 0.1; done
  echo "slurm-testbed: munged did not start" >&2; exit 1
}

write_conf() {
  local n=$1 ctl; ctl=$(hostname -s)
  {
    echo "127.0.0.1 localhost"
    echo "$NET.1 $ctl"
    for k in $(seq "$n"); do echo "$NET.$((10 + k)) n$k"; done
  } >"$STATE/hosts"
  cat >"$CONF" <<CFG
ClusterName=stagefs
SlurmctldHost=$ctl($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
CFG
  # the machine's cgroups as they are (v1 where the v2 hierarchy is not the only one)
  if [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; then
    echo "CgroupPlugin=cgroup/v2" >"$STATE/cgroup.conf"
  else
    echo "CgroupPlugin=cgroup/v1" >"$STATE/cgroup.conf"
  fi
  echo "CgroupMountpoint=/sys/fs/cgroup" >>"$STATE/cgroup.conf"
  for k in $(seq "$n"); do
    echo "NodeName=n$k NodeAddr=$NET.$((10 + k)) NodeHostname=n$k CPUs=2 RealMemory=4096 State=UNKNOWN" >>"$CONF"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$CONF"
}

start() {
  local n=4 shm=512m
  while (($#)); do
    case $1 in
      --shm) shm=$2; shift 2 ;;
      *) n=$1; shift ;;
    esac
  done
  if [[ -f $STATE/nodes ]]; then echo "slurm-testbed: already running ($(cat "$STATE/nodes") nodes)"; return 0; fi
  need_packages
  mkdir -p "$STATE"/{state,log}
  for k in $(seq "$n"); do mkdir -p "$STATE/spool/n$k"; done
  start_munge
  ip link show "$BR" >/dev/null 2>&1 || {
    ip link add "$BR" type bridge
    ip addr add "$NET.1/24" dev "$BR"
    ip link set "$BR" up
  }
  write_conf "$n"
  for k in $(seq "$n"); do
    local ns=sfs-n$k
    ip netns list | grep -qw "$ns" || {
      ip netns add "$ns"
      ip link add "$ns-h" type veth peer name "$ns-p"
      ip link set "$ns-p" netns "$ns"
      ip link set "$ns-h" master "$BR"; ip link set "$ns-h" up
      ip netns exec "$ns" ip addr add "$NET.$((10 + k))/24" dev "$ns-p"
      ip netns exec "$ns" ip link set "$ns-p" up
      ip netns exec "$ns" ip link set lo up
      ip netns exec "$ns" ip route add default via "$NET.1"
    }
  done
  slurmctld -f "$CONF" -i
  for k in $(seq "$n"); do
    # a node: its own network, host name, /dev/shm and /etc/hosts; the rest is shared
    # (nsenter, not 'ip netns exec', which would remount /sys and hide the cgroups)
    setsid unshare --mount --uts --propagation private bash -c "
      hostname n$k
      mount -t tmpfs -o size=$shm,mode=1777 tmpfs /dev/shm
      mount --bind '$STATE/hosts' /etc/hosts
      mount -t tmpfs -o size=$shm tmpfs /mnt && mkdir /mnt/nvme   # its local disk
      exec nsenter --net=/run/netns/sfs-n$k slurmd -D -N n$k -f '$CONF'" \
      >"$STATE/log/slurmd-n$k.out" 2>&1 </dev/null &
  done
  echo "$n" >"$STATE/nodes"
  export SLURM_CONF=$CONF
  for _ in $(seq 150); do
    if [[ $(sinfo -h -N -o %T 2>/dev/null | grep -c idle) -eq $n ]]; then
      echo "slurm-testbed: $n nodes up (n1..n$n); eval \"\$($0 env)\" to use them"
      return 0
    fi
    sleep 0.2
  done
  echo "slurm-testbed: the nodes did not come up; see $STATE/log" >&2
  sinfo -N >&2 || true
  return 1
}

stop() {
  export SLURM_CONF=$CONF
  [[ -f $STATE/nodes ]] || { echo "slurm-testbed: not running"; return 0; }
  local n; n=$(cat "$STATE/nodes")
  scancel --full --quiet --user=root 2>/dev/null || true
  for k in $(seq "$n"); do
    ip netns pids "sfs-n$k" 2>/dev/null | xargs -r kill -TERM 2>/dev/null || true
  done
  [[ -f $STATE/slurmctld.pid ]] && kill -TERM "$(cat "$STATE/slurmctld.pid")" 2>/dev/null || true
  sleep 0.5
  for k in $(seq "$n"); do
    ip netns pids "sfs-n$k" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip link del "sfs-n$k-h" 2>/dev/null || true
    ip netns del "sfs-n$k" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  rm -rf "$STATE"
  echo "slurm-testbed: stopped"
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) export SLURM_CONF=$CONF; sinfo -N; squeue ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start [N] [--shm SIZE] | stop | status | env" >&2; exit 2 ;;
esac
