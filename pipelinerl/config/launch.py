"""The `launch` section: where the roles run, locally or on Slurm."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.config.fields import check, check_choice, check_positive, doc, section

DEFAULT = "the cluster's default (no such #SBATCH line)"


@dataclass
class SlurmConfig:
    """Slurm resources; each field names the #SBATCH flag it sets. null = the cluster's default."""

    account: str | None = doc(None, "--account", null=DEFAULT)
    partition: str | None = doc(None, "--partition", null=DEFAULT)
    qos: str | None = doc(None, "--qos", null=DEFAULT)
    time: str = doc("3-00:00:00", "--time, D-HH:MM:SS")
    inference_nodes: int = doc(1, "--nodes of het component 0 (vLLM servers); 0 = colocated: every training node "
                                  "also serves, on launch.inference_gpus (slurm/run_7b_one_node.sh)")
    training_nodes: int = doc(1, "--nodes of het component 1 (DeepSpeed trainer + actor)")
    gpus_per_node: int | None = doc(8, "--gpus-per-node", null="none: CPU-only clusters")
    cpus_per_task: int | None = doc(None, "--cpus-per-task", null=DEFAULT)
    mem: str | None = doc(None, "--mem, e.g. \"0\" for the whole node", null=DEFAULT)
    signal_seconds: int = doc(300, "--signal=B:USR1@N: checkpoint and requeue N seconds before the time limit; "
                                   "the trainer gets N - 30 s to checkpoint (submitit sets it; scripts: #SBATCH)",
                              unit="s")
    master_port: int | None = doc(None, "trainer's MASTER_PORT on the first training node",
                                  null="20000 + job id % 10000 (jobs sharing a node then differ)")

    def __post_init__(self) -> None:
        check(self.inference_nodes >= 0, "launch.slurm.inference_nodes", "must be >= 0 (0 = colocated)")
        check_positive(self.training_nodes, "launch.slurm.training_nodes")
        check_positive(self.gpus_per_node, "launch.slurm.gpus_per_node", allow_null=True)
        check_positive(self.cpus_per_task, "launch.slurm.cpus_per_task", allow_null=True)
        check(self.signal_seconds >= 0, "launch.slurm.signal_seconds", "must be >= 0")
        check(self.master_port is None or 1 <= self.master_port <= 65535, "launch.slurm.master_port",
              "must be a TCP port, or null to derive one from the job id")


@dataclass
class LaunchConfig:
    """Where the roles run."""

    backend: str = doc("local", "local (child processes of `pipelinerl run`) | slurm")
    torch_threads: int | None = doc(None, "torch threads (OMP_NUM_THREADS) per process of a role without CPU cores of "
                                          "its own; a pinned role takes its cores' count", null="torch's default")
    inference_gpus: str | None = doc(
        None, "GPU ids of a node the servers use, e.g. \"0-3\" (tensor_parallel_size contiguous ids per server). "
              "Locally, and on Slurm only with slurm.inference_nodes=0 (ids are positions in the step's "
              "CUDA_VISIBLE_DEVICES); separate inference nodes use all their GPUs and setting this is an error",
        null="the first half of the node's GPUs")
    training_gpus: str | None = doc(None, "GPU ids of a node the trainer ranks use, one per rank, e.g. \"4-7\"; "
                                          "same scope as inference_gpus, and disjoint from it",
                                    null="the second half of the node's GPUs")
    gpu_memory_gb: float | None = doc(
        None, "memory of one GPU, for `pipelinerl plan` and the check `run` / the Slurm launcher make before "
              "starting anything (every role's per-GPU budget must fit in it)", unit="GB (10^9 bytes)",
        null="what nvidia-smi reports on the launching machine (its smallest GPU); no GPU there: no plan (CPU runs)")
    host_memory_gb: float | None = doc(
        None, "host RAM of one node, checked by `pipelinerl plan` and before starting against what each node's roles "
              "hold in host memory (servers' update staging and delta bases, trainer rank 0's published versions)",
        unit="GB (10^9 bytes)", null="this machine's memory for a local run; on Slurm launch.slurm.mem when it names "
                                     "a size, else not checked")
    inference_cpus: str | None = doc(
        None, "CPU cores the servers own, e.g. \"0-7\": equal contiguous blocks, one per server slot (policy, then "
              "reference and reward; the eval servers have eval_cpus), set as each server's CPU affinity and as "
              "vLLM-CPU's OMP binding (VLLM_CPU_OMP_THREADS_BIND, one list per tensor-parallel worker). Local "
              "launcher only (on Slurm, Slurm places cores: --cpus-per-task)",
        null="with training_cpus set: the cores no other list names; with neither set: no pinning (every role "
             "floats over every core)")
    training_cpus: str | None = doc(
        None, "CPU cores the trainer owns, e.g. \"8-15\", disjoint from inference_cpus; its ranks share them, "
              "each with cores / ranks torch threads", null="the cores no other list names (see inference_cpus)")
    actor_cpus: str | None = doc(None, "CPU cores of the actor, e.g. \"15\"; may share cores with the other roles "
                                       "(it mostly waits on HTTP)",
                                 null="the cores neither servers nor trainer own; none left: not pinned")
    eval_cpus: str | None = doc(
        None, "CPU cores of the eval servers (inference.eval_servers), e.g. \"1\", shared by all of them: set as "
              "their CPU affinity and vLLM-CPU's OMP binding like inference_cpus (at least tensor_parallel_size "
              "cores). May overlap the trainer's or any other role's cores (an eval server mostly waits); not part "
              "of the inference_cpus split. Local launcher only",
        null="not pinned: the eval servers float over every core")
    max_restarts: int = doc(
        3, "restarts of one role that died (a server, the actor, the trainer; on Slurm a server is restarted by its "
           "node's agent, the trainer and actor steps by the job) within any restart_window_s; one more death stops "
           "the run, naming the role and its log. A server restarts from the latest checkpoint, the trainer resumes "
           "from it, the actor continues its stream. 0 = no restarts: any role's death stops the run")
    restart_window_s: float = doc(3600.0, "the sliding window max_restarts counts a role's restarts in; older "
                                          "restarts are forgotten", unit="s")
    server_health_timeout_s: float | None = doc(
        60.0, "a server that has announced itself (RUN_DIR/servers, reference_servers, eval_servers, ...) and then "
              "does not answer GET /health for this long is dead: the launcher (on Slurm, its node's agent) logs it, "
              "SIGKILLs its process group and restarts it as after any death (max_restarts). A server still "
              "starting is left to inference.startup_timeout_s", unit="s",
        null="no health check: only a server's exit is its death")
    network_interface: str | None = doc(
        None, "the network interface (e.g. ib0, eth0) gloo and NCCL use between nodes on Slurm: the launcher sets "
              "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to it for every role, where they are not set already",
        null="each process takes the interface of its route to its group's master (trainer ranks: the first "
             "training node; servers: trainer rank 0), never a loopback name its hostname may resolve to")
    slurm: SlurmConfig = section(SlurmConfig)

    def __post_init__(self) -> None:
        from pipelinerl.config.ids import parse_gpu_ids

        check_choice(self.backend, ("local", "slurm"), "launch.backend")
        check_positive(self.torch_threads, "launch.torch_threads", allow_null=True)
        check_positive(self.gpu_memory_gb, "launch.gpu_memory_gb", allow_null=True)
        check_positive(self.host_memory_gb, "launch.host_memory_gb", allow_null=True)
        check(self.max_restarts >= 0, "launch.max_restarts", f"got {self.max_restarts!r}; must be >= 0 (0: none)")
        check_positive(self.restart_window_s, "launch.restart_window_s")
        check_positive(self.server_health_timeout_s, "launch.server_health_timeout_s", allow_null=True)
        for name in ("inference_gpus", "training_gpus"):
            try:
                if getattr(self, name) is not None:
                    parse_gpu_ids(getattr(self, name))
            except ValueError as err:
                check(False, f"launch.{name}", str(err))
        self._check_cpus()

    def _check_cpus(self) -> None:
        """The core lists' syntax and overlap; whether this machine has the cores is checked at launch."""
        from pipelinerl.config.ids import parse_cpu_ids

        cores = {}
        for name in ("inference_cpus", "training_cpus", "actor_cpus", "eval_cpus"):
            if getattr(self, name) is None:
                continue
            check(self.backend == "local", f"launch.{name}", "is for the local launcher; on Slurm, Slurm places the "
                  "cores (launch.slurm.cpus_per_task): unset it")
            try:
                cores[name] = set(parse_cpu_ids(getattr(self, name)))
            except ValueError as err:
                check(False, f"launch.{name}", str(err))
        shared = cores.get("inference_cpus", set()) & cores.get("training_cpus", set())
        check(not shared, "launch.training_cpus", f"shares core(s) {sorted(shared)} with launch.inference_cpus; "
              "servers and trainer need disjoint cores")
