"""Bandwidth each link needs for Decoupled DiLoCo, synchronous DiLoCo and data-parallel.

A closed-form planner (no simulation): for a model size, an inner step time, learners and their
regions, fragments P, sync period H, overlap tau and the wire codecs, it returns the average and the
required bandwidth of every learner link, every region's WAN link and the syncer, with the
assumptions spelled out. Back-of-envelope of the paper (Douillard et al., arXiv 2604.21428): per
learner and inner step Decoupled DiLoCo uploads |theta| / H values at b bits, data-parallel
all-reduces about 2 |theta| values within the step, a ratio of about 2 * 16 * H / b (192 for
H = 24 and int4). Byte counts per codec mirror `ddiloco.compression` without importing torch, so the
command answers in milliseconds (a unit test keeps the two in step). `ddiloco.plan.run_bytes`
predicts the exact bytes of ddiloco's own runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ddiloco.checks import invalid
from ddiloco.data_parallel import ring_allreduce_bytes

BITS_PER_BYTE = 8
GBPS = 1e9
"""Bandwidth is reported in Gbit/s (10^9 bits per second), the unit links are sold in."""

FLOAT32_BYTES = 4
INT_BLOCK_SIZE = 64
"""ddiloco's int4 / int2 codecs keep one float32 scale per block of 64 values."""
INT8_BLOCK_SIZE = 256
"""ddiloco's int8 codec (the default downlink) keeps one float32 scale per block of 256 values."""


@dataclass(frozen=True)
class WireFormat:
    """Bytes of one tensor of n values: ceil(n * bits / 8) of codes plus float32 scales."""

    bits_per_value: int
    block_size: int = 0
    """Values per scale; 0: no per-block scales."""
    tensor_scale_bytes: int = 0
    """Bytes of one scale for the whole tensor (fp8)."""

    def nbytes(self, numel: int) -> int:
        code_bytes = -(-numel * self.bits_per_value // BITS_PER_BYTE)
        block_scales = -(-numel // self.block_size) * FLOAT32_BYTES if self.block_size else 0
        return code_bytes + block_scales + self.tensor_scale_bytes


WIRE_FORMATS = {
    "fp32": WireFormat(32),
    "bf16": WireFormat(16),
    "fp8": WireFormat(8, tensor_scale_bytes=FLOAT32_BYTES),
    "int8": WireFormat(8, block_size=INT8_BLOCK_SIZE),
    "int4": WireFormat(4, block_size=INT_BLOCK_SIZE),
    "int2": WireFormat(2, block_size=INT_BLOCK_SIZE),
}
"""The byte layouts of `ddiloco.compression` (see its module docstring)."""


def encoded_nbytes(codec: str, numel: int) -> int:
    """Bytes of one encoded tensor of `numel` values, as ddiloco's codecs write it."""
    if codec not in WIRE_FORMATS:
        raise invalid("codec", codec, f"one of {', '.join(WIRE_FORMATS)}")
    if numel < 0:
        raise ValueError(f"numel={numel} is invalid: expected >= 0")
    return WIRE_FORMATS[codec].nbytes(numel)


def parse_regions(spec: str, learners: int) -> dict[str, int]:
    """'us-east:2,us-west:2' -> learners per region; '' -> every learner in its own region."""
    if not spec.strip():
        return {f"region-{m}": 1 for m in range(learners)}
    out: dict[str, int] = {}
    for item in spec.split(","):
        name, _, count = item.strip().partition(":")
        try:
            value = int(count) if count else 1
        except ValueError:
            value = -1
        if not name or value < 1 or name in out:
            raise ValueError(f"regions={spec!r} is invalid: expected name[:learners],... with distinct names and "
                             f"learners >= 1, e.g. 'us-east:2,us-west:2'")
        out[name] = value
    if sum(out.values()) != learners:
        raise ValueError(f"regions={spec!r} places {sum(out.values())} learners but learners={learners}")
    return out


@dataclass(frozen=True, kw_only=True)
class BandwidthConfig:
    """A layout to size links for."""

    params: float = 12e9
    """Parameters of the model (12e9 for a 12B model)."""
    step_time_s: float = 2.0
    """Seconds one inner step takes on a learner (compute only)."""
    learners: int = 4
    """M: learners (data-parallel: replicas), one or more per region."""
    regions: str = ""
    """Learners per region, 'name:count,...' (e.g. 'us-east:2,us-west:2'); empty: one region per learner."""
    syncer_region: str = ""
    """Region of the syncer; its learners' traffic stays local. Empty: a region with no learner."""
    num_fragments: int = 24
    """P: fragments; each is synchronised once per H inner steps."""
    sync_every: int = 24
    """H, in inner steps."""
    overlap_steps: int = 2
    """tau, in inner steps: time a round may take, upload to download, without stalling the learner."""
    codec: str = "int4"
    """Uplink codec of pseudo-gradients (fp32, bf16, fp8, int8, int4, int2)."""
    downlink_codec: str = "int8"
    """Codec of merged fragments sent back (ddiloco's default int8 sends each round's change, which learners
    and syncer rebuild identically: `ddiloco.downlink`; fp32 sends the value itself)."""
    gradient_codec: str = "bf16"
    """Data type of data-parallel gradients in the all-reduce."""
    blocking_overhead: float = 0.05
    """Share of compute time a blocking synchronisation may add: synchronous DiLoCo, and Decoupled
    DiLoCo with tau = 0."""

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}")

        require(math.isfinite(self.params) and self.params >= 1, "params", "a number of parameters >= 1")
        require(math.isfinite(self.step_time_s) and self.step_time_s > 0, "step_time_s", "seconds > 0")
        require(isinstance(self.learners, int) and self.learners >= 1, "learners", "an integer >= 1")
        require(isinstance(self.num_fragments, int) and self.num_fragments >= 1, "num_fragments", "an integer >= 1")
        # More fragments than parameters counted a value per fragment: 1e14 fragments of 12e9 parameters needed 83,333
        # Gbps instead of about 2.
        require(self.num_fragments <= self.params, "num_fragments",
                f"at most the model's parameters ({self.params:g}): a fragment holds at least one")
        require(isinstance(self.sync_every, int) and self.sync_every >= 1, "sync_every", "an integer >= 1")
        require(isinstance(self.overlap_steps, int) and self.overlap_steps >= 0, "overlap_steps", "an integer >= 0")
        for name in ("codec", "downlink_codec", "gradient_codec"):
            require(getattr(self, name) in WIRE_FORMATS, name, "one of " + ", ".join(WIRE_FORMATS))
        require(0 < self.blocking_overhead <= 1, "blocking_overhead", "a share in (0, 1]")
        regions = parse_regions(self.regions, self.learners)
        if self.syncer_region and self.regions and self.syncer_region not in regions:
            raise ValueError(f"syncer_region={self.syncer_region!r} is invalid: expected one of "
                             f"{', '.join(regions)} (or empty)")

    def region_learners(self) -> dict[str, int]:
        return parse_regions(self.regions, self.learners)


@dataclass(frozen=True)
class LinkDemand:
    """Traffic of one link. Rates in bits per second."""

    name: str
    up_bps: float
    """Average rate away from the learners (towards the syncer or the other sites)."""
    down_bps: float
    """Average rate towards the learners."""
    required_bps: float
    """Bandwidth per direction a full-duplex link needs so that nobody waits."""

    def to_dict(self) -> dict[str, float | str]:
        return {"name": self.name, "up_gbps": self.up_bps / GBPS, "down_gbps": self.down_bps / GBPS,
                "required_gbps": self.required_bps / GBPS}

    def times(self, count: int, name: str) -> LinkDemand:
        return LinkDemand(name, count * self.up_bps, count * self.down_bps, count * self.required_bps)


@dataclass(frozen=True)
class SystemBandwidth:
    system: str
    up_bytes_per_inner_step: float
    """Per learner, averaged over inner steps."""
    down_bytes_per_inner_step: float
    learner: LinkDemand
    regions: tuple[LinkDemand, ...]
    syncer: LinkDemand | None

    def to_dict(self) -> dict:
        return {"system": self.system, "up_bytes_per_inner_step": self.up_bytes_per_inner_step,
                "down_bytes_per_inner_step": self.down_bytes_per_inner_step,
                "learner_link": self.learner.to_dict(), "region_links": [r.to_dict() for r in self.regions],
                "syncer": None if self.syncer is None else self.syncer.to_dict()}


@dataclass(frozen=True)
class BandwidthPlan:
    config: BandwidthConfig
    systems: tuple[SystemBandwidth, ...]
    assumptions: tuple[str, ...] = field(default=())

    def by_system(self) -> dict[str, SystemBandwidth]:
        return {s.system: s for s in self.systems}

    def to_dict(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "systems": [s.to_dict() for s in self.systems],
                "assumptions": list(self.assumptions)}


def _star(config: BandwidthConfig, system: str, up_round: float, down_round: float, steps_per_round: float,
          required: float) -> SystemBandwidth:
    """A learner-to-syncer layout: per-learner rates, WAN links per region, the syncer's link."""
    period_s = steps_per_round * config.step_time_s
    learner = LinkDemand("learner", up_round * BITS_PER_BYTE / period_s, down_round * BITS_PER_BYTE / period_s,
                         required)
    regions = config.region_learners()
    links = [learner.times(count, f"WAN {name}") for name, count in regions.items() if name != config.syncer_region]
    remote = sum(count for name, count in regions.items() if name != config.syncer_region)
    if config.syncer_region:
        links.append(learner.times(remote, f"WAN {config.syncer_region} (syncer)"))
    syncer = learner.times(config.learners, "syncer")
    return SystemBandwidth(system, up_round / steps_per_round, down_round / steps_per_round, learner,
                           tuple(links), syncer)


def decoupled(config: BandwidthConfig) -> SystemBandwidth:
    """One fragment of |theta| / P values per round, P rounds per H inner steps, tau steps of overlap."""
    fragment_values = math.ceil(config.params / config.num_fragments)
    up_round = encoded_nbytes(config.codec, fragment_values)
    down_round = encoded_nbytes(config.downlink_codec, fragment_values)
    steps_per_round = config.sync_every / config.num_fragments
    sustained = max(up_round, down_round) * BITS_PER_BYTE / (steps_per_round * config.step_time_s)
    if config.overlap_steps >= 1:
        window_s = config.overlap_steps * config.step_time_s
    else:
        window_s = config.blocking_overhead * steps_per_round * config.step_time_s
    round_trip = (up_round + down_round) * BITS_PER_BYTE / window_s
    return _star(config, "decoupled", up_round, down_round, steps_per_round, max(sustained, round_trip))


def synchronous_diloco(config: BandwidthConfig) -> SystemBandwidth:
    """The whole model every H inner steps; learners block while it moves."""
    values = math.ceil(config.params)
    up_round = encoded_nbytes(config.codec, values)
    down_round = encoded_nbytes(config.downlink_codec, values)
    window_s = config.blocking_overhead * config.sync_every * config.step_time_s
    required = (up_round + down_round) * BITS_PER_BYTE / window_s
    return _star(config, "synchronous_diloco", up_round, down_round, config.sync_every, required)


def data_parallel(config: BandwidthConfig) -> SystemBandwidth:
    """Ring all-reduce of the gradients across sites within every inner step."""
    sites = len(config.region_learners())
    gradient = encoded_nbytes(config.gradient_codec, math.ceil(config.params))
    per_step = ring_allreduce_bytes(sites, gradient)
    rate = per_step * BITS_PER_BYTE / config.step_time_s
    site = LinkDemand("region (one replica)", rate, rate, rate)
    links = tuple(LinkDemand(f"WAN {name}", rate, rate, rate) for name in config.region_learners())
    return SystemBandwidth("data_parallel", per_step, per_step, site, links if sites > 1 else (), None)


def assumptions(config: BandwidthConfig) -> tuple[str, ...]:
    c = config
    return (
        f"Model of {c.params:.4g} parameters; every learner takes one inner step every {c.step_time_s:g} s.",
        f"Decoupled DiLoCo: P = {c.num_fragments} fragments of params / P values (one tensor each; per-tensor "
        f"overheads ignored), synchronised one at a time, each once per H = {c.sync_every} inner steps: "
        f"a round every H / P = {c.sync_every / c.num_fragments:g} inner steps. Uplink: the pseudo-gradient "
        f"in {c.codec}; downlink: the merged fragment in {c.downlink_codec}.",
        f"A round's upload and download run one after the other and must complete within tau = "
        f"{c.overlap_steps} inner steps (tau = 0: the learner blocks, and the transfer may add "
        f"{c.blocking_overhead:.0%} to the compute between rounds); the syncer's merge time, quorum waits "
        "and network latency are neglected. Links are full duplex; 'required' is the larger of each "
        "direction's average rate and that round-trip window.",
        f"Synchronous DiLoCo: the whole model (P = 1) every H = {c.sync_every} inner steps, same codecs, "
        f"through the same syncer; learners block, and the transfer may add {c.blocking_overhead:.0%} to "
        "the compute of the H steps.",
        f"Data-parallel: one replica per region; {c.gradient_codec} gradients all-reduced across regions "
        "with a ring (each region sends and receives 2 (S - 1) / S gradients per inner step, S regions), "
        "fully overlapped with the step's compute, so it must finish within one inner step; traffic inside "
        "a region is free.",
        "Regions: learners in the syncer's region do not cross the WAN; a region's WAN link carries all of "
        "its learners' traffic; the syncer's link carries every learner's.",
        f"Codec bytes are ddiloco's: fp32 4 B/value, bf16 2, fp8 1 + a 4 B scale per tensor, int8 1 + a 4 B "
        f"scale per {INT8_BLOCK_SIZE} values, int4 0.5 + a 4 B scale per {INT_BLOCK_SIZE} values, int2 0.25 + "
        "the same scales. 1 Gbps = 1e9 bit/s.",
    )


def plan_bandwidth(config: BandwidthConfig) -> BandwidthPlan:
    """Every system's link demands for `config`, with the assumptions they rest on."""
    return BandwidthPlan(config, (decoupled(config), synchronous_diloco(config), data_parallel(config)),
                         assumptions(config))
