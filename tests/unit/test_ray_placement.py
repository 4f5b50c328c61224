"""What `ddiloco run --ray` asks of Ray: a plain `--ray` starts a local instance even where another cluster is
known on this machine, and the role actors run where Ray's worker does not SIGKILL the learner as it exits. Ray is
replaced by a recorder here; tests/integration/test_ray_driver_kill.py checks both against a real Ray."""

from __future__ import annotations

from types import SimpleNamespace

from ddiloco.runtime import ray_cluster
from ddiloco.runtime.launcher import LaunchConfig, Launcher
from ddiloco.runtime.ray_cluster import RayCluster
from ddiloco.runtime.ray_options import RayOptions
from ddiloco.runtime.ray_supervisor import RaySupervisor
from ddiloco.runtime.supervised_roles import SupervisorConfig


class RecordingRay(SimpleNamespace):
    """The part of the `ray` module `RayCluster.start` uses, recording `ray.init`'s arguments."""

    def __init__(self) -> None:
        super().__init__(inits=[])

    def init(self, **kwargs) -> None:
        self.inits.append(kwargs)

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 2.0}


class RecordingActorClass:
    """`ray.remote(RoleActor)`, recording the options each actor is created with."""

    def __init__(self) -> None:
        self.options_seen: list[dict] = []

    def options(self, **options) -> RecordingActorClass:
        self.options_seen.append(options)
        return self

    def remote(self, spec) -> object:
        return object()


def test_plain_ray_starts_a_local_instance_even_where_ray_address_names_a_cluster(monkeypatch):
    # Without address="local", ray.init(num_cpus=...) joins what RAY_ADDRESS (or `ray start`'s
    # /tmp/ray/ray_current_cluster) names, and refuses num_cpus there.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    fake = RecordingRay()
    monkeypatch.setattr(ray_cluster, "import_ray", lambda: fake)
    cluster = RayCluster(RayOptions())
    line = cluster.start(cpus_needed=3)
    assert [init.get("address") for init in fake.inits] == ["local"]
    assert fake.inits[0]["num_cpus"] >= 3 and cluster.started_local
    assert line.startswith("started a local Ray instance")


def test_every_role_actor_runs_where_rays_worker_leaves_its_children_to_pdeathsig(tmp_path):
    launcher = Launcher(LaunchConfig(run_dir=tmp_path, num_learners=2, threads=1, evaluator=True))
    supervisor = RaySupervisor(SupervisorConfig(), launcher=launcher, options=RayOptions())
    actors = RecordingActorClass()
    supervisor._actor_class = actors
    supervisor._create(supervisor.syncer, supervisor._spec("syncer", "syncer"), num_cpus=1, num_gpus=0)
    for slot in supervisor._learner_slots:
        supervisor._create_learner(slot)
    assert [options["name"].rsplit("-", 1)[-1] for options in actors.options_seen] == ["syncer", "0", "1",
                                                                                       "evaluator"]
    for options in actors.options_seen:
        env = options.get("runtime_env", {}).get("env_vars", {})
        assert env.get("RAY_kill_child_processes_on_worker_exit") == "false", options
