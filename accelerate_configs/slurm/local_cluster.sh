#!/bin/bash
# A real two-node SLURM cluster on this one machine, to try train.sbatch before a real cluster:
#   bash accelerate_configs/slurm/local_cluster.sh up      # (make cluster)  then: . runs/cluster/env.sh
#   bash accelerate_configs/slurm/local_cluster.sh down    # (make cluster-down) stops it, removes what it made
#   bash accelerate_configs/slurm/local_cluster.sh node-up node2   # brings back a node whose processes were killed
# Hosts node1 and node2 are network namespaces (their own address, hostname and /etc/hosts) on a
# bridge whose address is the controller's and the database's: slurmctld, slurmdbd (on MariaDB, for
# sacct) and PostgreSQL (shared sweeps) run on this machine, one slurmd per host. Needs root (network
# namespaces); installs the Debian packages with apt when they are missing. Everything it writes is under runs/cluster, plus the
# namespaces, the bridge and /etc/netns/node*; `down` removes them all. docs/cluster.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
STATE=$PWD/runs/cluster
BRIDGE=slurmbr0 SUBNET=10.88.0 NODES=(node1 node2)
CONTROLLER=$SUBNET.1 CTL_PORT=6917 NODE_PORT=6918 DBD_PORT=6919 PG_PORT=5433 MARIADB_PORT=3307
PG_BIN=/usr/lib/postgresql/15/bin
export SLURM_CONF=$STATE/slurm.conf

die() { echo "error: $*" >&2; exit 1; }
address() { echo "$SUBNET.$((10 + ${1#node}))"; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  command -v slurmdbd >/dev/null || missing+=(slurmdbd)
  command -v mariadbd >/dev/null || missing+=(mariadb-server)
  [ -x $PG_BIN/postgres ] || missing+=(postgresql)
  command -v ip >/dev/null || missing+=(iproute2)
  [ ${#missing[@]} = 0 ] && return
  echo "installing ${missing[*]} (apt)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  # Debian starts the packages' own services; this cluster runs its own daemons on other ports
  for service in slurmctld slurmd slurmdbd munge mariadb postgresql; do service "$service" stop >/dev/null 2>&1 || true; done
}

network() {
  touch "$STATE/network"  # what down may remove: the bridge, the namespaces and /etc/netns entries made here
  ip link add "$BRIDGE" type bridge
  ip addr add "$CONTROLLER/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for node in "${NODES[@]}"; do
    ip netns add "$node"
    ip link add "veth-$node" type veth peer name eth0 netns "$node"
    ip link set "veth-$node" master "$BRIDGE" up
    ip -n "$node" addr add "$(address "$node")/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" link set lo up
    # `ip netns exec` mounts /etc/netns/NODE/hosts over /etc/hosts: every host knows the others by name
    mkdir -p "/etc/netns/$node"
    { grep -v "[[:space:]]\(node[0-9]*\|controller\)\$" /etc/hosts || true
      echo "$CONTROLLER controller"; for n in "${NODES[@]}"; do echo "$(address "$n") $n"; done; } > "/etc/netns/$node/hosts"
  done
}

munge_daemon() {
  mkdir -p "$STATE/munge" && chmod 700 "$STATE/munge"
  [ -f "$STATE/munge/munge.key" ] || { dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 2>/dev/null; chmod 400 "$STATE/munge/munge.key"; }
  # its own socket and key, not the machine's munged: nothing outside runs/cluster changes
  munged --force --socket="$STATE/munge/socket" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/seed" 2>/dev/null
}

accounting() {  # sacct's store: slurmdbd on a MariaDB server of its own (SLURM's only database)
  local data=$STATE/mariadb
  if [ ! -d "$data/mysql" ]; then
    mkdir -p "$data" && chown mysql: "$data"
    mariadb-install-db --user=mysql --datadir="$data" --auth-root-authentication-method=socket >/dev/null
  fi
  setsid -f mariadbd --user=mysql --datadir="$data" --socket="$data/socket" --bind-address=127.0.0.1 --port=$MARIADB_PORT \
    --pid-file="$data/pid" --log-error="$data/error.log" --innodb-buffer-pool-size=64M >/dev/null 2>&1
  for _ in $(seq 60); do mariadb-admin --socket="$data/socket" ping >/dev/null 2>&1 && break; sleep 0.5; done
  mariadb --socket="$data/socket" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
    die "MariaDB did not start; see $data/error.log"
  # beside slurm.conf, where slurmdbd looks for it; its password makes it the SlurmUser's alone
  cat > "$STATE/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/socket
DbdHost=localhost
DbdAddr=$CONTROLLER
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$MARIADB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$STATE/slurmdbd.conf"
  slurmdbd
  # slurmctld stops at once if slurmdbd does not answer when it starts
  for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && return; sleep 0.5; done
  die "slurmdbd does not answer after 30 s; see $STATE/slurmdbd.log"
}

slurm_conf() {
  mkdir -p "$STATE/slurmctld"
  cat > "$SLURM_CONF" <<EOF
# written by accelerate_configs/slurm/local_cluster.sh
ClusterName=local
SlurmctldHost=$(hostname)($CONTROLLER)
SlurmctldPort=$CTL_PORT
SlurmdPort=$NODE_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=socket=$STATE/munge/socket,cred_expire=20
StateSaveLocation=$STATE/slurmctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdSpoolDir=$STATE/spool-%n
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdLogFile=$STATE/slurmd-%n.log
# no cgroups: this machine's cgroup mounts are not SLURM's to take
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# cores shared by up to 4 jobs (OverSubscribe=FORCE:4), memory not counted: small CPU jobs side by side
SelectTypeParameters=CR_Core
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CONTROLLER
AccountingStoragePort=$DBD_PORT
# for slurmdbd's connections, the munge socket
AccountingStoragePass=$STATE/munge/socket
JobAcctGatherType=jobacct_gather/none
# a node silent for 20 s is DOWN (its jobs requeued or ended); a slurmd that registers again returns
SlurmdTimeout=20
ReturnToService=2
KillWait=10
NodeName=DEFAULT CPUs=$(nproc) RealMemory=4000 State=UNKNOWN
EOF
  for node in "${NODES[@]}"; do echo "NodeName=$node NodeAddr=$(address "$node")" >> "$SLURM_CONF"; done
  echo "PartitionName=main Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >> "$SLURM_CONF"
  # this machine mounts cgroup v1 and v2 together, where slurmd's cgroup autodetection fails
  printf 'CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' > "$STATE/cgroup.conf"
}

node_up() {  # slurmd in the host's namespace, under the host's own hostname
  local node=$1
  alive "$STATE/slurmd-$node.pid" && return
  ip netns exec "$node" unshare --uts sh -c "hostname $node && exec slurmd -f '$SLURM_CONF' -N $node"
}

postgres() {
  local data=$STATE/postgres
  if [ ! -f "$data/PG_VERSION" ]; then
    mkdir -p "$data" && chown postgres: "$data" && chmod 700 "$data"
    runuser -u postgres -- test -w "$data" || die "the postgres user cannot write $data (a folder above it is closed to it); clone the repository where it can"
    runuser -u postgres -- $PG_BIN/initdb -D "$data" -U postgres --auth=trust >/dev/null
    echo "host all all $SUBNET.0/24 trust" >> "$data/pg_hba.conf"
  fi
  runuser -u postgres -- $PG_BIN/pg_ctl -D "$data" -l "$data/server.log" -w -o "-c listen_addresses=$CONTROLLER -p $PG_PORT -k $data" start >/dev/null
  runuser -u postgres -- $PG_BIN/psql -h "$data" -p $PG_PORT -tAc "SELECT 1 FROM pg_database WHERE datname = 'optuna'" | grep -q 1 ||
    runuser -u postgres -- $PG_BIN/createdb -h "$data" -p $PG_PORT optuna
}

wait_up() {  # every node responding: idle, or running jobs (mix, alloc)
  local up
  for _ in $(seq 60); do
    up=$(sinfo -h -N -o "%N %t" 2>/dev/null | grep -c " \(idle\|mix\|alloc\)$" || true)
    [ "$up" = ${#NODES[@]} ] && return
    sleep 1
  done
  sinfo -N >&2 || true
  die "the nodes are not up after 60 s; see $STATE/slurmctld.log and $STATE/slurmd-node*.log"
}

up() {
  [ "$(id -u)" = 0 ] || die "the cluster needs root (network namespaces, daemons); run it as root or with sudo"
  if alive "$STATE/slurmctld.pid" && [ -f "$STATE/env.sh" ]; then
    for node in "${NODES[@]}"; do node_up "$node"; done
    wait_up
    echo "the cluster is up: . runs/cluster/env.sh"
    return
  fi
  if [ ! -f "$STATE/network" ]; then  # never take over or remove a bridge or namespace this checkout did not make
    for name in "${NODES[@]}"; do
      if ip netns pids "$name" >/dev/null 2>&1 || [ -e "/etc/netns/$name" ]; then
        die "a network namespace $name (or /etc/netns/$name) exists that this checkout did not make: another local cluster? run \`make cluster-down\` where it was started"
      fi
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
      die "a bridge $BRIDGE exists that this checkout did not make: another local cluster? run \`make cluster-down\` where it was started"
    fi
  fi
  down >/dev/null 2>&1 || true  # what a crashed cluster of this checkout left
  install_packages
  mkdir -p "$STATE"
  network
  munge_daemon
  slurm_conf
  accounting
  slurmctld -f "$SLURM_CONF"
  for node in "${NODES[@]}"; do node_up "$node"; done
  postgres
  cat > "$STATE/env.sh" <<EOF
# . runs/cluster/env.sh: sbatch, squeue, scontrol and sinfo talk to the local cluster
export SLURM_CONF=$SLURM_CONF
export CLUSTER_NODES="${NODES[*]}"
export CLUSTER_DATABASE=postgresql://postgres@$CONTROLLER:$PG_PORT/optuna
EOF
  wait_up
  echo "the cluster is up: nodes ${NODES[*]}, controller and database at $CONTROLLER; . runs/cluster/env.sh"
}

stop_pid() {  # the daemon in the pid file, SIGTERM then SIGKILL
  alive "$1" || return 0
  local pid; pid=$(cat "$1"); kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  if [ -f "$STATE/network" ]; then
    for node in "${NODES[@]}"; do
      # every process of the host: slurmd and whatever its jobs left
      ip netns pids "$node" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
      ip netns del "$node" 2>/dev/null || true
      rm -rf "/etc/netns/$node"
    done
  fi
  stop_pid "$STATE/slurmctld.pid"
  stop_pid "$STATE/slurmdbd.pid"
  stop_pid "$STATE/mariadb/pid"
  [ -f "$STATE/postgres/postmaster.pid" ] && runuser -u postgres -- $PG_BIN/pg_ctl -D "$STATE/postgres" -m fast stop >/dev/null || true
  stop_pid "$STATE/munge/munged.pid"
  [ -f "$STATE/network" ] && ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
  echo "the cluster is down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  node-up) [ -n "${2:-}" ] || die "node-up needs a node name (${NODES[*]})"; node_up "$2"; wait_up ;;
  *) die "usage: $0 up|down|node-up NODE" ;;
esac
