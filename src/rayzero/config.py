"""The run configuration: one frozen dataclass per component, composed in `Config`.

Presets live in `rayzero/configs/*.yaml` (also reachable as `configs/` at the repo root). A preset is
merged over the dataclass defaults, then command-line overrides (`section.field=value`) over the preset,
through OmegaConf, which rejects unknown keys and values of the wrong type. Each dataclass validates its
own ranges in `__post_init__`, so a bad value fails at start-up with the field, the value and what is
valid. Every component receives only its own section.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayzero.tree.base import SearchConfig

PRESETS_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, the value and what is valid."""


def _check(section: str, obj: Any, rules: list[tuple[str, bool, str]]) -> None:
    for name, ok, valid in rules:
        if not ok:
            raise ConfigError(f"{section}.{name}={getattr(obj, name)!r} is invalid: must be {valid}")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which environment to play and how its observations are prepared."""

    id: str = "CartPole-v1"
    """Any Gymnasium env id; ids of the ALE namespace (e.g. 'ALE/Pong-v5') use ale-py's native vector env."""
    num_envs: int = 16
    """Environments stepped together by each self-play actor. 0: the plan's (cluster/plan.py, `selfplay_envs`):
    more where whole searches run on a GPU, so that the other groups' steps cover a search's time."""
    frame_skip: int = 4
    """Atari: frames per step (max-pooled over the last 2)."""
    grayscale: bool = False
    """Atari: grayscale instead of RGB frames."""
    image_size: int = 96
    """Atari: frames are resized to image_size x image_size (64, 84 or 96)."""
    frame_stack: int = 4
    """Atari: frames stacked in one observation."""
    noop_max: int = 30
    """Atari: up to this many no-op actions at reset."""
    sticky_action_prob: float = 0.25
    """Atari: repeat_action_probability (0.25 = v5 semantics)."""
    train_sticky_action_prob: float | None = None
    """Atari: repeat_action_probability of the self-play envs only (None = sticky_action_prob); evaluation keeps
    sticky_action_prob. EfficientZero and LightZero train on deterministic NoFrameskip-v4 games (0)."""
    full_action_space: bool = False
    """Atari: all 18 actions instead of the game's minimal set."""
    episodic_life: bool = True
    """Atari: a lost life ends the episode for training (never for evaluation)."""
    fire_reset: bool = False
    """Atari, games whose action set has FIRE: the env presses FIRE for the first `envs.FIRE_RESET_STEPS` steps
    of every life (a new game, and after a lost life), in training and evaluation alike, in place of the agent's
    action (`StepResult.actions` says what was played). Breakout waits for FIRE to serve: a greedy agent whose
    search ranks FIRE low there waits until the step cap (OpenAI Baselines' and EnvPool's fire reset)."""
    clip_rewards: bool = False
    """Clip training rewards to [-1, 1] (never for evaluation)."""
    max_episode_steps: int = 0
    """Truncate episodes after this many steps (0 = the env's own limit; Atari default 27000 = 108k frames)."""
    search_groups: int = 2
    """With the inference actor's whole searches: the self-play actor's envs in this many vector envs, each with
    its search in flight while the others step (2: two halves; more give each search longer to come back, in
    smaller requests). CPU search (search.device=cpu) always uses two halves."""
    num_threads: int = 0
    """Atari: native threads stepping each vector env. 0: for self-play, the cluster's CPUs over its self-play
    actors (the plan's env_threads; one actor gets a thread per CPU), elsewhere one per env up to the CPUs the
    process may use."""

    def __post_init__(self) -> None:
        _check("env", self, [
            ("id", bool(self.id), "a Gymnasium env id such as 'CartPole-v1' or 'ALE/Pong-v5'"),
            ("num_envs", self.num_envs >= 0, ">= 1, or 0 for the plan's choice"),
            ("frame_skip", self.frame_skip >= 1, ">= 1"),
            ("image_size", self.image_size in (64, 84, 96), "64, 84 or 96"),
            ("frame_stack", self.frame_stack >= 1, ">= 1"),
            ("noop_max", self.noop_max >= 0, ">= 0"),
            ("sticky_action_prob", 0.0 <= self.sticky_action_prob < 1.0, "in [0, 1)"),
            ("train_sticky_action_prob", self.train_sticky_action_prob is None
             or 0.0 <= self.train_sticky_action_prob < 1.0, "in [0, 1), or None (= sticky_action_prob)"),
            ("max_episode_steps", self.max_episode_steps >= 0, ">= 0"),
            ("fire_reset", not self.fire_reset or self.is_atari,
             f"false for ids outside the ALE namespace (FIRE is an Atari action; id {self.id!r})"),
            ("num_threads", self.num_threads >= 0, ">= 0 (0 = one per env, up to the CPUs)"),
            ("search_groups", self.search_groups >= 1, ">= 1 (2 = two halves)"),
        ])

    @property
    def is_atari(self) -> bool:
        return self.id.startswith("ALE/")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The MuZero networks: representation, dynamics and prediction."""

    kind: str = "auto"
    """'mlp' for vector observations, 'resnet' for images, 'transformer' (models/transformer.py), or 'auto'."""
    latent_dim: int = 64
    """MLP: size of the latent state."""
    hidden: int = 128
    """MLP: width of hidden layers."""
    channels: int = 64
    """ResNet: channels of the latent planes."""
    blocks: int = 1
    """ResNet: residual blocks in each of representation, dynamics and prediction."""
    reduced_channels: int = 16
    """ResNet: channels of the 1x1 convs before the value/reward/policy heads."""
    head_hidden: int = 32
    """ResNet: hidden width of the fully connected heads."""
    downsample: int = 16
    """ResNet: how much the representation shrinks each image side: 16 (EfficientZero's: 96x96 -> 6x6) or 8 (no
    last average pool: LightZero's 64x64 grayscale frames -> 8x8)."""
    support_size: int = 300
    """Value and reward are categorical over [-support_size, support_size] after the h-transform (601 bins)."""
    value_prefix: bool = False
    """EfficientZero's value prefix (mlp and resnet): an LSTM over the unrolled states predicts the sum of the
    rewards since the root (restarting every value_prefix_horizon steps) instead of each step's reward; the
    search reads a step's reward as the difference of consecutive prefixes."""
    latent_norm: str = "minmax"
    """How the mlp and resnet latents are scaled after representation and each dynamics step: 'minmax', each
    sample's latent to [0, 1] (MuZero's); 'none', as the last block leaves it (LightZero's `state_norm=False`)."""
    lstm_hidden: int = 64
    """Hidden size of the value-prefix LSTM."""
    value_prefix_horizon: int = 5
    """Steps after which the prefix and the LSTM state restart from zero."""
    transformer_dim: int = 256
    """Transformer: width of the tokens."""
    transformer_heads: int = 8
    """Transformer: attention heads (must divide transformer_dim)."""
    transformer_layers: int = 6
    """Transformer: blocks in each of representation and dynamics."""
    transformer_latent_tokens: int = 8
    """Transformer: tokens of the latent state."""
    transformer_patch: int = 0
    """Transformer: side of the square image patches that become tokens (0 = the smallest that fits
    transformer_max_tokens)."""
    transformer_max_tokens: int = 512
    """Transformer: most input tokens of one observation."""

    def __post_init__(self) -> None:
        _check("model", self, [
            ("lstm_hidden", self.lstm_hidden >= 1, ">= 1"),
            ("latent_norm", self.latent_norm in ("minmax", "none"), "'minmax' or 'none'"),
            ("latent_norm", self.latent_norm == "minmax" or self.kind != "transformer",
             "'minmax' with model.kind='transformer' (the knob is built for 'mlp' and 'resnet')"),
            ("value_prefix_horizon", self.value_prefix_horizon >= 1, ">= 1"),
            ("value_prefix", not (self.value_prefix and self.kind == "transformer"),
             "false with model.kind='transformer' (value prefix is built for 'mlp' and 'resnet')"),
            ("kind", self.kind in ("auto", "mlp", "resnet", "transformer"), "'auto', 'mlp', 'resnet' or 'transformer'"),
            ("latent_dim", self.latent_dim >= 1, ">= 1"),
            ("hidden", self.hidden >= 1, ">= 1"),
            ("channels", self.channels >= 1, ">= 1"),
            ("blocks", self.blocks >= 0, ">= 0"),
            ("reduced_channels", self.reduced_channels >= 1, ">= 1"),
            ("head_hidden", self.head_hidden >= 1, ">= 1"),
            ("downsample", self.downsample in (8, 16), "8 or 16"),
            ("support_size", self.support_size >= 1, ">= 1"),
            ("transformer_dim", self.transformer_dim >= 1, ">= 1"),
            ("transformer_heads", self.transformer_heads >= 1 and self.transformer_dim % self.transformer_heads == 0,
             ">= 1 and a divisor of model.transformer_dim"),
            ("transformer_layers", self.transformer_layers >= 1, ">= 1"),
            ("transformer_latent_tokens", self.transformer_latent_tokens >= 1, ">= 1"),
            ("transformer_patch", self.transformer_patch >= 0, ">= 0 (0 = auto)"),
            ("transformer_max_tokens", self.transformer_max_tokens >= 1, ">= 1"),
        ])


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """The prioritised replay buffer and its targets."""

    capacity: int = 100_000
    """Transitions kept; the oldest segments are evicted first."""
    unroll_steps: int = 5
    """K: dynamics steps unrolled by the learner."""
    td_steps: int = 10
    """n of the n-step value targets."""
    discount: float = 0.997
    """Discount of rewards and value bootstraps."""
    priority_alpha: float = 1.0
    """Sampling probability proportional to priority**alpha (0 = uniform)."""
    priority_beta: float = 1.0
    """Importance-sampling exponent of the loss weights."""
    segment_length: int = 200
    """Steps per segment sent from a self-play actor (episodes that end sooner send what they have)."""
    min_size: int = 1000
    """Transitions needed before the learner starts."""
    shared_obs: bool = False
    """Keep observations in node-local shared memory (/dev/shm): learners on the replay's node gather them
    straight into pinned memory instead of receiving them through Ray (for image observations, where a batch
    is large). Falls back to private memory, with a warning, when /dev/shm is too small."""
    next_obs: bool = False
    """Batches carry the observations at t+1..t+K (needed by learner.consistency_weight > 0)."""
    bootstrap_obs: bool = False
    """Batches carry the observations n = td_steps ahead and leave the stored search value out of the value
    target, so the learner bootstraps with its target network (needed by learner.target_update_interval > 0)."""
    frame_stack: int = 0
    """Image observations that stack this many frames (env.frame_stack) are stored as single frames, plus the
    older frames of each segment's first observation, and restacked when sampled: about frame_stack times
    less memory (0 or 1 = store observations whole). Each segment then takes frame_stack - 1 extra slots."""
    shards: int = 0
    """Replay actors (0 = one per learner rank). Each holds capacity/shards transitions; self-play actor i writes
    to shard i % shards and learner rank r samples shard r % shards, so no single actor serves every rank."""

    def __post_init__(self) -> None:
        _check("replay", self, [
            ("capacity", self.capacity >= 1, ">= 1"),
            ("shards", self.shards >= 0, ">= 0 (0 = one per learner rank)"),
            ("frame_stack", self.frame_stack >= 0, ">= 0 (0 or 1 = observations stored whole)"),
            ("unroll_steps", self.unroll_steps >= 1, ">= 1"),
            ("td_steps", self.td_steps >= 1, ">= 1"),
            ("discount", 0.0 < self.discount <= 1.0, "in (0, 1]"),
            ("priority_alpha", self.priority_alpha >= 0, ">= 0"),
            ("priority_beta", self.priority_beta >= 0, ">= 0"),
            ("segment_length", self.segment_length >= 1, ">= 1"),
            ("min_size", 0 <= self.min_size <= self.capacity, "between 0 and replay.capacity"),
        ])


@dataclasses.dataclass(frozen=True)
class ReanalyseConfig:
    """Reanalyse (MuZero Reanalyze): workers re-run the search on stored positions with the latest weights and
    replace those positions' policy targets and search values (the n-step bootstraps) in replay."""

    fraction: float = 0.0
    """Positions re-searched per sample the learner trains on (0 = off; 0.5 = one for every two samples)."""
    batch_size: int = 256
    """Positions per reanalyse call: one batched search over them."""

    def __post_init__(self) -> None:
        _check("reanalyse", self, [
            ("fraction", self.fraction >= 0, ">= 0 (0 = off)"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
        ])


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
INFERENCE_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
"""inference.compile_mode's: the modes that leave CUDA graphs to the inference actor's own captures."""
COMPILE_BACKENDS = ("inductor", "aot_eager")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """Training of the networks."""

    batch_size: int = 256
    """Samples per learner step."""
    optimizer: str = "adamw"
    """'adamw', or 'sgd' with momentum (learner.momentum): EfficientZero's and LightZero's Atari optimizer
    (SGD at lr 0.2, momentum 0.9, weight decay 1e-4), whose step follows the gradient's size where AdamW
    normalises it away per parameter."""
    momentum: float = 0.9
    """Momentum of learner.optimizer=sgd (unused by adamw)."""
    lr: float = 3e-3
    """Peak learning rate of the optimizer."""
    lr_warmup_steps: int = 200
    """Linear warm-up steps."""
    lr_decay_steps: int = 0
    """Cosine decay to lr * lr_final_fraction over this many steps (0 = constant after warm-up)."""
    lr_final_fraction: float = 0.1
    """See lr_decay_steps."""
    weight_decay: float = 1e-4
    """Weight decay: decoupled for AdamW, an L2 term in the gradient for SGD (as torch.optim.SGD applies it)."""
    grad_clip: float = 5.0
    """Global gradient norm clip (0 = off)."""
    value_loss_weight: float = 0.25
    """Weight of the value cross-entropy."""
    replay_ratio: float = 8.0
    """Target (learner samples) / (env steps); the driver throttles whichever side runs ahead."""
    steps_per_call: int = 50
    """Learner steps per remote call (between weight publications)."""
    calls_in_flight: int = 1
    """Train calls the driver keeps queued at the learner. With 2 (the `atari` preset) the next call is already
    waiting when one ends, so the learner does not idle while the driver takes in a result and publishes its
    weights (~10 % of a Pong run's time, docs/benchmarks.md); published weights are then a call older."""
    warmup_transitions: int = 0
    """With a compiling learner (CUDA), the most transitions self-play adds before the learner's first call
    returns; self-play then waits for it (0 = no cap). Uncapped, a minute of compiling fills replay with the
    initial network's play, which the learner then samples for minutes."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda'."""
    bf16: bool = True
    """bf16 autocast on CUDA."""
    checkpoint_interval: int = 1000
    """Learner steps between checkpoints."""
    compile: bool | None = None
    """torch.compile the loss (forward and backward); None = on CUDA only. Falls back to eager, with a
    logged warning, when compilation fails."""
    compile_mode: str = "reduce-overhead"
    """torch.compile mode. 'reduce-overhead' replays the step as CUDA graphs: without them the compiled step is
    bound by Python launching its kernels (docs/benchmarks.md). Also 'default', 'max-autotune',
    'max-autotune-no-cudagraphs'. A mode that fails falls back to 'default', then to eager."""
    compile_backend: str = "inductor"
    """torch.compile backend: 'inductor' (kernels generated for the step); 'aot_eager' traces the step (graphs,
    autograd) without generating kernels, which compiles in seconds: for debugging a compile failure, and tests."""
    compile_regions: bool = False
    """Compile the loss as three regions, each traced once: the unroll's root, one unrolled step (called K times)
    and the consistency targets, instead of one graph of the whole K-step unroll; a model with a value prefix
    compiles whole. A smaller graph to compile, at the cost of fusion across the regions' few boundaries (under
    learner.step_graph they add no kernel launches). Measure both with scripts/compile_cost.py."""
    regions_first: bool = False
    """With background_compile and the loss compiled whole (compile_regions false): helpers also compile the loss
    as regions, which compile in about half the time; the learner trains on the regions' step once those are
    done, and moves to the whole loss's faster step when its helper is (compiled here from the warm cache, and
    checked against eager as any compiled step). Where the whole loss's helper is done by then too (a warm
    cache), the learner compiles the whole loss at once. If the whole loss fails, the regions' step goes on."""
    background_compile: bool = False
    """Fill the compile cache in a helper process, from the first batch, while the first updates run eagerly;
    once it is done the learner compiles from the warm cache (seconds, not the minutes of a cold compile) and
    goes on compiled. A single learner only (DDP ranks compile in step, as without it). If the helper fails the
    learner compiles in its own process, as without it."""
    early_compile: bool = False
    """With background_compile, on a local Ray whose plan puts the learner on a GPU of the driver's machine: the
    driver starts the helpers as soon as the plan is made, on a batch of the run's fields, shapes and dtypes made
    by the run's own replay code from random segments (the compile cache keys on those, not on values), so that
    they may be done by the learner's first update instead of starting at it. The learner then waits on those
    helpers rather than its own; its log counts the compile cache's hits and misses."""
    prewarm_dir: str = ""
    """Set by the driver (learner.early_compile): where the helpers it started report. Not a user setting."""
    compile_check_steps: int = 8
    """The first updates of each compiled mode also run eagerly, from the same state, and the compiled gradient
    norm must be within 25 % of eager's; otherwise the learner logs both and falls back to the next mode (then
    eager). Those updates apply the eager gradients. A guard against silent miscompiles, which torch 2.11's
    inductor made of this step (docs/benchmarks.md, ninth session). 0 turns it off; a DDP rank never checks."""
    step_graph: bool = True
    """On CUDA, an update without CUDA graphs of its own (eager: while learner.background_compile's helper
    compiles, after compiling failed or was caught computing wrong gradients, or with compile false; or compiled
    in a mode without graphs, such as 'default') is captured once, whole, as one CUDA graph and replayed for each
    batch: such updates are otherwise bound by launching their kernels (learner/step_graph.py). A single learner
    only; a failed capture is logged and training goes on without it."""
    compile_side_steps: bool = True
    """Compile the no-grad computations the step's inputs need (the target network's bootstraps, the
    consistency targets) when the step is compiled; false runs them eagerly: a shorter first step (the
    compile delays every run's first update) at some cost per step."""
    channels_last: bool = False
    """Keep the conv net and image batches in NHWC memory format (off: slower than NCHW with torch.compile,
    docs/benchmarks.md). Ignored for vector observations."""
    prefetch: int = 2
    """Batches sampled, gathered into pinned memory and copied to the device ahead of the update (0 = in line)."""
    gather_threads: int = 4
    """Threads gathering observations from the replay's shared memory (replay.shared_obs) into pinned memory."""
    obs_cache: bool | None = None
    """Keep a copy of the replay's shared observations in device memory, filled as positions are sampled, so
    only new positions cross the host (None = on CUDA when the whole replay fits in half the free memory)."""
    target_update_interval: int = 0
    """Learner steps between copies of the network into the target network that computes the n-step value
    bootstraps (0 = no target network: the stored search values bootstrap). Needs replay.bootstrap_obs=true."""
    consistency_weight: float = 0.0
    """Weight of EfficientZero's self-supervised consistency loss: negative cosine between the projected
    latent after k dynamics steps and the (stop-gradient) projected representation of the observation at
    t+k (0 = off). Needs replay.next_obs=true."""
    consistency_dim: int = 256
    """Width of the consistency projection (and of its prediction head's hidden layer)."""
    consistency_targets: str = "separate"
    """Where the consistency loss's stop-gradient targets are computed: 'separate', beforehand by a function of
    their own (compiled like the target network's bootstraps, without CUDA graphs) and handed to the step as an
    input; 'step', inside the compiled step. With 'step' under CUDA graphs (torch 2.11, H200) the cosine does not
    train and the gradient norm jumps 20x after the first step, while eager trains it (docs/benchmarks.md);
    the learner warns when asked for that combination."""
    dynamics_grad_scale: float = 0.5
    """Factor on the gradient entering each dynamics step of the unroll: MuZero's and EfficientZero's 0.5 (so
    the representation is not dominated by K steps of model-learning gradient); LightZero's MuZero uses 1."""
    unroll_step_weight: float | None = None
    """Weight of each unrolled step's loss terms, the root's being 1; None = 1/K (MuZero's), so deeper unrolls
    do not dominate. 1 weighs every step as the root (LightZero's relative weights; it scales the whole sum by
    1/K, which for SGD is lr/K)."""
    shift_pixels: int = 0
    """Image observations: shift each training image (the root's, and the next observations of the consistency
    loss) by a random offset of up to this many pixels each way, edges replicated (EfficientZero's and
    LightZero's random-shift augmentation, 4 there); 0 = off. Bootstrap observations are not shifted."""
    manual_gc: bool = True
    """Python's garbage collector off during `train` calls, with a young-generation collection at the end of each
    call (all ranks at the same point) and a full one every 20 calls. An automatic collection pauses one rank
    at a random step and the other ranks wait for it at the all-reduce (Megatron-LM's --manual-gc does the same
    for the same reason). Results report `gc_collections` and `gc_ms` during the call."""
    grad_sync: str = "flat"
    """How the ranks of a learner group average gradients (both over torch.distributed, NCCL or gloo).
    'flat': after the backward, every gradient packed into one buffer and all-reduced at once. 'ddp': torch's
    DistributedDataParallel (buckets all-reduced as gradients become ready, gradients kept as views of the
    buckets). A compiled backward hands all gradients over together, so DDP cannot overlap its all-reduce with
    the backward, and its per-parameter bucket copies are extra kernels (docs/benchmarks.md). Either way BatchNorm statistics stay per rank (rank 0's are published) and the
    parameters equal one rank's on the combined batch (tests/test_learner_ddp.py)."""

    def __post_init__(self) -> None:
        _check("learner", self, [
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("optimizer", self.optimizer in ("adamw", "sgd"), "'adamw' or 'sgd'"),
            ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
            ("lr", self.lr > 0, "> 0"),
            ("lr_warmup_steps", self.lr_warmup_steps >= 0, ">= 0"),
            ("lr_decay_steps", self.lr_decay_steps >= 0, ">= 0"),
            ("lr_final_fraction", 0 <= self.lr_final_fraction <= 1, "in [0, 1]"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("grad_clip", self.grad_clip >= 0, ">= 0"),
            ("value_loss_weight", self.value_loss_weight >= 0, ">= 0"),
            ("replay_ratio", self.replay_ratio > 0, "> 0"),
            ("steps_per_call", self.steps_per_call >= 1, ">= 1"),
            ("calls_in_flight", self.calls_in_flight >= 1, ">= 1"),
            ("warmup_transitions", self.warmup_transitions >= 0, ">= 0 (0 = no cap)"),
            ("device", self.device in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'"),
            ("checkpoint_interval", self.checkpoint_interval >= 1, ">= 1"),
            ("compile_mode", self.compile_mode in COMPILE_MODES, f"one of {COMPILE_MODES}"),
            ("compile_check_steps", self.compile_check_steps >= 0, ">= 0"),
            ("compile_backend", self.compile_backend in COMPILE_BACKENDS, f"one of {COMPILE_BACKENDS}"),
            ("prefetch", self.prefetch >= 0, ">= 0"),
            ("gather_threads", self.gather_threads >= 1, ">= 1"),
            ("target_update_interval", self.target_update_interval >= 0, ">= 0"),
            ("consistency_weight", self.consistency_weight >= 0, ">= 0"),
            ("consistency_dim", self.consistency_dim >= 1, ">= 1"),
            ("consistency_targets", self.consistency_targets in ("step", "separate"), "'step' or 'separate'"),
            ("shift_pixels", self.shift_pixels >= 0, ">= 0 (0 = off)"),
            ("dynamics_grad_scale", 0 < self.dynamics_grad_scale <= 1, "in (0, 1]"),
            ("unroll_step_weight", self.unroll_step_weight is None or self.unroll_step_weight > 0,
             "> 0, or None (= 1/K)"),
            ("grad_sync", self.grad_sync in ("ddp", "flat"), "'ddp' or 'flat'"),
            ("regions_first", not (self.regions_first and self.compile_regions),
             "false with compile_regions true (regions_first moves from the regions to the whole loss)"),
        ])


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    """The central inference actor (or a local network copy in each self-play actor)."""

    mode: str = "auto"
    """'local' (each self-play actor evaluates with its own copy), 'central' (one inference actor),
    or 'auto' (central when a GPU is present, local otherwise)."""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda'."""
    max_batch: int = 4096
    """Largest bucket of the batching ladder."""
    min_bucket: int = 8
    """Smallest bucket; the ladder doubles from here up to max_batch."""
    ladder_steps: int = 1
    """Buckets per doubling of the ladder: 1 gives 8, 16, 32, ...; 2 adds the midpoints 12, 24, 48, ..., so a batch
    a few rows past a bucket pads to 1.5x instead of 2x, at twice the graphs captured at start-up."""
    max_wait_us: int = 500
    """Longest a request waits for others to fill a bucket."""
    latent_pool_size: int = 65536
    """Latent slots kept on the inference device for searches controlled from the CPU."""
    cuda_graphs: bool = True
    """Capture one CUDA graph per bucket (CUDA only)."""
    network_graphs: str = "auto"
    """With cuda_graphs, the network's own graphs captured at start-up. 'all': the initial and the recurrent step
    for every bucket (requests from trees walked elsewhere: search.device=cpu, or reanalyse and evaluation
    searching locally); 'search': only the initial step for the whole-search buckets (a whole search's roots; its
    own graph holds the recurrent steps), and other requests run eagerly; 'auto': the plan's, 'search' where every
    search of the run is a whole search on this actor, else 'all'."""
    bf16: bool = True
    """bf16 trunk with fp32 heads (CUDA only)."""
    fp32_heads: bool = True
    """With bf16: run the value, reward and policy heads in float32 (False = everything bf16)."""
    channels_last: bool = True
    """CUDA: keep conv weights in channels-last layout (NHWC kernels for bf16 convs; docs/benchmarks.md)."""
    search_max_batch: int = 1024
    """Largest bucket of whole-search CUDA graphs (one per bucket of the ladder up to here, captured at
    start-up for the run's search config; other configs are captured on first use). Bigger search
    requests run eagerly; 0 = no whole-search graphs."""
    bucket_cut: bool = False
    """CUDA, whole searches: while a batch is on the device, the next one may stop at a smaller bucket of the
    ladder where that moves more rows per device second (the mean device time of each bucket so far); the
    requests left over go first in the batch after. Without it, a few rows past a bucket run the next bucket's
    graph, mostly padding. Off until a GPU has measured it (`rayzero bench selfplay --rows preset,cut`)."""
    search_lanes: int = 1
    """CUDA: whole searches in flight at once, each lane a copy of the network with its own stream, buffers
    and whole-search graphs (the first lane is the served network, which also runs every other batch). A
    search is mostly a chain of small kernels, so searches on several streams may overlap on the GPU
    (scripts/search_lanes.py measures it). 1 = one search after another, the default until `rayzero bench
    selfplay --rows lanes2,lanes3` has measured lanes in self-play."""
    stream_priority: str = "high"
    """CUDA: which side the GPU schedules first where a learner shares this process (cluster.colocate_learner).
    'high': the inference actor's streams take the highest priority, so self-play and evaluation, which wait
    for each answer, are not queued behind a training step. 'low': they take the lowest and the learner's
    stream the highest, for a run whose replay ratio makes the learner the bound (self-play then only fills
    the GPU's gaps, and is held to the ratio anyway)."""
    merge_searches: bool = False
    """Whole searches that differ only in their acting settings (temperature, root-noise fraction or Gumbel
    scale) share batches, each row searching with its own: greedy evaluation and reanalyse join self-play's
    batches instead of taking the GPU for searches of their own (tree/noise.py, per-row settings)."""
    pinned_eval: bool = False
    """A second copy of the network, with graphs of its own captured at start, holds the weights an evaluation
    was given (`set_eval_weights`), so that each evaluation plays one agent. Otherwise (false) an evaluation
    searches with the served weights of each moment, which move on with the learner while its games play (an
    evaluation of 100-190 s spans ~20 K updates in a Pong run); merged into self-play's batches, it costs no
    searches of its own."""
    latent_timeout_s: float = 0.0
    """Free the latent slots of a client idle this long (seconds; 0 = only when the pool runs short, oldest
    client first)."""
    poll_interval_us: int = 20
    """How often the actor's poller thread sweeps the shared-memory channels for new requests while requests
    come or are in flight (microseconds; it backs off when they stop). Each sweep takes the actor's GIL: a longer
    interval leaves more of a core and of the GIL to the rest, and adds up to itself to a request's wait, small
    beside a whole search's milliseconds (`rayzero bench selfplay --rows preset,poll100`)."""
    sleep_waits: bool = True
    """CUDA: the GPU thread sleeps in the driver while a batch runs (a blocking event), where a plain CUDA wait
    spins a whole core for as long as the GPU works, a core that an env-bound host's envs need; it wakes some
    microseconds later than a spinning wait would. A lone search (one client, nothing to join it) always spins,
    as its client waits on nothing else (`rayzero bench selfplay --rows preset,spin` compares)."""
    cache_size: int = 0
    """Entries of the initial-inference cache keyed by an observation hash (LRU; 0 = off). Cleared on
    every weight update."""
    channels: bool = True
    """Let clients on the actor's node send initial and recurrent requests through shared-memory channels
    (inference/channel.py) instead of Ray calls; clients elsewhere use Ray calls either way."""
    switch_interval_us: int = 20
    """CUDA: the Python thread switch interval the actor sets (its GPU thread and its event loop share the
    GIL; with Python's default of 5000 us the GPU thread waits for it after CUDA calls); 0 = Python's."""
    compile_recurrent: bool = False
    """torch.compile the network's recurrent step (dynamic batch: one compile at start-up, some seconds), so that
    each simulation of a search runs inductor's fused kernels instead of ~70 eager ones. Whole searches run
    faster at every batch size (docs/benchmarks.md, twenty-third session). The atari preset turns it on; off by
    default (not measured with the other presets' networks)."""
    compile_mode: str = "default"
    """With compile_recurrent: inductor's mode. 'default', or 'max-autotune-no-cudagraphs' (inductor times its own
    Triton templates for the convs and matmuls against cuDNN/cuBLAS and keeps the faster, at a longer start-up;
    its graphs are this actor's own captures either way)."""
    max_queue: int = 0
    """Backpressure: most rows waiting in the actor's queues (0 = 4 x max_batch). A request that would go beyond
    fails at once with `InferenceOverloaded` (retry later); one that finds the queues empty is always taken."""

    def __post_init__(self) -> None:
        _check("inference", self, [
            ("mode", self.mode in ("auto", "local", "central"), "'auto', 'local' or 'central'"),
            ("device", self.device in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'"),
            ("max_batch", self.max_batch >= 1, ">= 1"),
            ("min_bucket", 1 <= self.min_bucket <= self.max_batch, "between 1 and inference.max_batch"),
            ("ladder_steps", 1 <= self.ladder_steps <= 8, "between 1 and 8 (buckets per doubling)"),
            ("max_wait_us", self.max_wait_us >= 0, ">= 0"),
            ("latent_pool_size", self.latent_pool_size >= 1, ">= 1"),
            ("search_max_batch", self.search_max_batch >= 0, ">= 0 (0 = no whole-search graphs)"),
            ("search_lanes", 1 <= self.search_lanes <= 8, "between 1 and 8"),
            ("latent_timeout_s", self.latent_timeout_s >= 0, ">= 0 (0 = no timeout)"),
            ("cache_size", self.cache_size >= 0, ">= 0 (0 = no cache)"),
            ("switch_interval_us", self.switch_interval_us >= 0, ">= 0 (0 = Python's default)"),
            ("max_queue", self.max_queue >= 0, ">= 0 (0 = 4 x inference.max_batch)"),
            ("poll_interval_us", 1 <= self.poll_interval_us <= 100_000, "between 1 and 100000"),
            ("stream_priority", self.stream_priority in ("high", "low"), "'high' or 'low'"),
            ("network_graphs", self.network_graphs in ("auto", "all", "search"), "'auto', 'all' or 'search'"),
            ("compile_mode", self.compile_mode in INFERENCE_COMPILE_MODES, f"one of {INFERENCE_COMPILE_MODES}"),
        ])


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Ray resources; `rayzero.cluster` is the only place that reads this."""

    num_selfplay_actors: int = 0
    """Self-play actors (each steps env.num_envs envs); 0 = from the host: the whole CPUs that the other roles'
    requests, the inference actor and (above 4 CPUs) 2 for the driver and replay leave, at least 1."""
    selfplay_cpus: float = 1.0
    """CPUs reserved per self-play actor."""
    learner_cpus: float = 1.0
    """CPUs reserved for the learner."""
    learner_gpus: float = 0.0
    """GPUs per learner rank (0 = from learner.device and the host: a whole GPU when there are two or more,
    half of the only one otherwise, the inference actor taking the other half; none without GPUs)."""
    num_learners: int = 1
    """Learner ranks (DDP); > 1 needs GPUs or uses gloo on the CPU."""
    replay_cpus: float = 0.0
    """CPUs reserved for the replay actor (0: it mostly waits)."""
    inference_gpus: float = 0.0
    """GPUs for the central inference actor."""
    colocate_learner: bool = False
    """Run the learner inside the central inference actor's process (cluster/colocated.py) where the two share one
    GPU (or have none): one CUDA context, with the learner on a stream of its own, instead of two processes taking
    turns on the GPU. The actor gets both roles' CPUs and GPUs. One learner only. Where inference is local, or
    the two roles have GPUs of their own, it is not applied, and the plan's table says why."""
    eval_cpus: float = 0.0
    """CPUs reserved for the evaluation actor."""
    num_reanalyse_workers: int = 1
    """Reanalyse actors (used when reanalyse.fraction > 0)."""
    reanalyse_cpus: float = 0.0
    """CPUs reserved per reanalyse actor. None by default, as for the evaluation actor: its work is paced by the
    learner's (reanalyse.fraction of the samples trained on), on a GPU host it only hands batches to the inference
    actor, and a core reserved for it on a 2-core machine left self-play none (the `atari` preset there). Reserve
    some where its searches run on the CPU of a host with cores to spare."""
    reanalyse_gpus: float = 0.0
    """GPUs (or a share of one) per reanalyse actor: its searches then run on that GPU."""
    torch_threads: int = 1
    """torch intra-op threads in each actor; an actor of a role with CPUs reserved runs at most that many
    (`plan.Role.torch_threads`), so actors sharing a host do not take each other's cores."""
    max_selfplay_actors: int = 0
    """Elastic self-play: grow up to this many actors while the cluster has free CPUs (0 = fixed at
    num_selfplay_actors). Actors lost with a node are dropped and replaced when resources return."""
    request_resources: bool = False
    """Ask the autoscaler (ray.autoscaler.sdk.request_resources) for max_selfplay_actors' CPUs."""
    address: str = ""
    """Ray address to connect to; empty = RAY_ADDRESS, a job's cluster, or a new local ray.init()."""
    num_cpus: int = 0
    """CPUs for a new local Ray (0 = all)."""

    def __post_init__(self) -> None:
        _check("cluster", self, [
            ("num_selfplay_actors", self.num_selfplay_actors >= 0, ">= 0 (0 = from the host's CPUs)"),
            ("selfplay_cpus", self.selfplay_cpus >= 0, ">= 0"),
            ("learner_cpus", self.learner_cpus >= 0, ">= 0"),
            ("learner_gpus", self.learner_gpus >= 0, ">= 0"),
            ("num_learners", self.num_learners >= 1, ">= 1"),
            ("colocate_learner", not self.colocate_learner or self.num_learners == 1,
             "false with cluster.num_learners > 1 (the learner in the inference actor is a single one)"),
            ("replay_cpus", self.replay_cpus >= 0, ">= 0"),
            ("inference_gpus", self.inference_gpus >= 0, ">= 0"),
            ("eval_cpus", self.eval_cpus >= 0, ">= 0"),
            ("num_reanalyse_workers", self.num_reanalyse_workers >= 1, ">= 1"),
            ("reanalyse_cpus", self.reanalyse_cpus >= 0, ">= 0"),
            ("reanalyse_gpus", self.reanalyse_gpus >= 0, ">= 0"),
            ("torch_threads", self.torch_threads >= 1, ">= 1"),
            ("num_cpus", self.num_cpus >= 0, ">= 0"),
            ("max_selfplay_actors", self.max_selfplay_actors == 0 or self.max_selfplay_actors >= self.num_selfplay_actors,
             "0 (fixed) or >= cluster.num_selfplay_actors"),
        ])


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The driver loop: budget, evaluation and outputs."""

    seed: int = 0
    """Seeds envs, networks and search noise."""
    time_limit: float = 0.0
    """Wall-clock seconds of the run (0 = no limit); `rayzero train` counts them from its own start, start-up
    (imports, Ray, building the actors) included, as do the metrics' `wall_seconds`."""
    max_env_steps: int = 0
    """Stop after this many env steps (0 = no limit)."""
    max_learner_steps: int = 0
    """Stop after this many learner steps (0 = no limit)."""
    eval_interval: float = 30.0
    """Seconds between evaluations while training."""
    eval_episodes: int = 10
    """Greedy episodes per evaluation (and in the final one)."""
    eval_max_steps: int = 27_000
    """Step cap of an evaluation episode."""
    eval_simulations: int = 0
    """Simulations of an evaluation's greedy searches (0 = search.num_simulations): an evaluation step's search is
    bound by its simulations one after another, so fewer make evaluations shorter and leave the GPU to the
    learner. Where searches run whole on a GPU, a number other than search.num_simulations needs
    inference.pinned_eval (the evaluation network's graphs, captured at start)."""
    eval_virtual_loss: int = 0
    """Virtual loss K of an evaluation's greedy searches (0 = search.virtual_loss). A short evaluation search at
    self-play's K is a few waves of K walks each: 1 keeps it one walk per network call. Where searches run whole on
    a GPU, a K other than search.virtual_loss needs inference.pinned_eval, as run.eval_simulations does."""
    final_eval_seconds: float = 0.0
    """Wall-clock budget of the final evaluation (0 = none), so that a run ends by its time_limit however long its
    agent's games have grown: with a time limit, training stops up to this long before it (at most a quarter of
    it; less when the last evaluation's games say the final one needs less, schedule.py), and the final
    evaluation plays the final weights alone on the GPU until the limit. Episodes still playing when it runs out
    count with their return so far, as at eval_max_steps, and the summary says how many (`eval_unfinished`)."""
    final_eval_max_steps: int = 0
    """Step cap of the final evaluation's episodes (0 = eval_max_steps). Playing alone on the GPU, it can afford
    longer games than the evaluations beside the learner."""
    stop_return: float = 0.0
    """Stop early once an evaluation's mean return reaches this (0 = never)."""
    # (learner step, temperature) pairs, typed loosely for OmegaConf: 2.3 cannot type a tuple of pairs (and
    # rejected the preset); __post_init__ checks and converts the pairs.
    temperature_schedule: tuple[Any, ...] = ((0, 1.0), (5000, 0.5), (10000, 0.25))
    """(learner step, visit temperature) pairs: self-play uses the last entry whose step has passed."""
    local_dir: str = ""
    """Local working copy of the run dir when --out is a URI (empty = a new temporary directory)."""
    log_interval: float = 5.0
    """Seconds between progress lines and metric rows."""
    selfplay_steps_per_call: int = 20
    """Batched env steps a self-play actor takes per remote call (weights are refreshed between calls)."""

    @property
    def final_steps(self) -> int:
        """The final evaluation's step cap: final_eval_max_steps, or eval_max_steps where that is 0."""
        return self.final_eval_max_steps or self.eval_max_steps

    def __post_init__(self) -> None:
        # OmegaConf hands sequences over as lists; keep the frozen dataclass hashable and comparable.
        try:
            schedule = tuple((int(step), float(temperature)) for step, temperature in self.temperature_schedule)
        except (TypeError, ValueError):
            schedule = None
        if schedule is None or not all(step >= 0 and temperature >= 0 for step, temperature in schedule):
            raise ConfigError(f"run.temperature_schedule={self.temperature_schedule!r} is invalid: must be a list of "
                              f"[learner step >= 0, temperature >= 0] pairs")
        object.__setattr__(self, "temperature_schedule", schedule)
        _check("run", self, [
            ("time_limit", self.time_limit >= 0, ">= 0"),
            ("max_env_steps", self.max_env_steps >= 0, ">= 0"),
            ("max_learner_steps", self.max_learner_steps >= 0, ">= 0"),
            ("eval_interval", self.eval_interval > 0, "> 0"),
            ("eval_episodes", self.eval_episodes >= 1, ">= 1"),
            ("eval_max_steps", self.eval_max_steps >= 1, ">= 1"),
            ("eval_simulations", self.eval_simulations >= 0, ">= 0 (0 = search.num_simulations)"),
            ("eval_virtual_loss", self.eval_virtual_loss >= 0, ">= 0 (0 = search.virtual_loss)"),
            ("final_eval_max_steps", self.final_eval_max_steps >= 0, ">= 0 (0 = eval_max_steps)"),
            ("final_eval_seconds", self.final_eval_seconds >= 0, ">= 0 (0 = no budget)"),
            ("log_interval", self.log_interval > 0, "> 0"),
            ("selfplay_steps_per_call", self.selfplay_steps_per_call >= 1, ">= 1"),
        ])


@dataclasses.dataclass(frozen=True)
class Config:
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    search: SearchConfig = dataclasses.field(default_factory=SearchConfig)
    replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    reanalyse: ReanalyseConfig = dataclasses.field(default_factory=ReanalyseConfig)
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    @property
    def eval_search(self) -> SearchConfig:
        """The search section as evaluations search (run.eval_simulations, run.eval_virtual_loss); greedy settings
        are applied where they play."""
        return dataclasses.replace(self.search, num_simulations=self.run.eval_simulations or self.search.num_simulations,
                                   virtual_loss=self.run.eval_virtual_loss or self.search.virtual_loss)

    def __post_init__(self) -> None:
        """Rules between sections (each section checks its own fields)."""
        replay, learner, env = self.replay, self.learner, self.env
        k = replay.frame_stack
        if k > 1 and not (env.is_atari and k == env.frame_stack):
            # Replay restacks single frames: only right for Atari observations that stack that many frames.
            raise ConfigError(f"replay.frame_stack={k} needs an Atari env (ALE/...) stacking {k} frames; got "
                              f"env.id={env.id!r} with env.frame_stack={env.frame_stack}: set replay.frame_stack "
                              f"to 0 or to env.frame_stack")
        if learner.consistency_weight > 0 and not replay.next_obs:
            raise ConfigError("learner.consistency_weight > 0 needs replay.next_obs=true")
        if learner.target_update_interval and not replay.bootstrap_obs:
            raise ConfigError("learner.target_update_interval > 0 needs replay.bootstrap_obs=true")
        if 0 < learner.warmup_transitions < replay.min_size:
            raise ConfigError(f"learner.warmup_transitions={learner.warmup_transitions} is below replay.min_size="
                              f"{replay.min_size}: the learner would never start; use 0 or >= {replay.min_size}")
        shards, ranks = replay.shards or self.cluster.num_learners, self.cluster.num_learners
        if ranks % shards:
            raise ConfigError(f"replay.shards={shards} must divide cluster.num_learners={ranks} (rank r samples "
                              f"shard r % shards, so every shard is trained on); valid: 0 (one per rank) or a "
                              f"divisor of {ranks}")
        segment = replay.segment_length + replay.unroll_steps + replay.td_steps
        if shards > 1 and replay.capacity // shards < segment:
            raise ConfigError(f"replay.capacity={replay.capacity} split over {shards} shards leaves "
                              f"{replay.capacity // shards} transitions per shard, less than one segment ({segment}); "
                              f"raise replay.capacity or lower replay.shards")


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {name_or_path!r} does not exist")
        return path
    candidate = PRESETS_DIR / f"{name_or_path}.yaml"
    if not candidate.exists():
        raise ConfigError(f"unknown config preset {name_or_path!r}: valid presets are {presets()} or a YAML file path")
    return candidate


def _convert(error: Exception) -> ConfigError:
    # OmegaConf errors carry a multi-line "full_key: ... object_type=..." trailer; keep the first line.
    message = str(error).strip().splitlines()[0]
    key = getattr(error, "full_key", None)
    if key and key not in message:
        message = f"{key}: {message}"
    return ConfigError(message)


def load(preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the preset (name or YAML path), then `section.field=value` overrides; validated."""
    try:
        base = OmegaConf.structured(Config)
        # omegaconf 2.3 marks the nodes of frozen dataclasses read-only, merges included; the dataclasses that
        # `to_object` makes stay frozen.
        for node in (base, *(base._get_node(key) for key in base)):
            OmegaConf.set_readonly(node, False)
        layers = [base]
        if preset:
            layers.append(OmegaConf.load(_preset_path(preset)))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not of the form section.field=value")
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise _convert(error) from None
    except ValueError as error:  # raised by a section's __post_init__
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error)) from None
    assert isinstance(config, Config)
    return config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))



def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring} of a config dataclass: the string literal under each field (read with `ast`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def describe(config: Config) -> str:
    """The config as YAML (it loads back as a preset), every field under a comment of its documentation."""
    import yaml

    lines = []
    for section in dataclasses.fields(config):
        part = getattr(config, section.name)
        summary = inspect.cleandoc(type(part).__doc__ or "").splitlines()
        lines.append(f"{section.name}:" + (f"  # {summary[0]}" if summary else ""))
        docs = field_docs(type(part))
        for field in dataclasses.fields(part):
            lines += [f"  # {line}".rstrip() for line in docs.get(field.name, "").splitlines()]
            value = yaml.safe_dump(_plain(getattr(part, field.name)), default_flow_style=True, width=1 << 20)
            value = value.strip().removesuffix("...").strip()
            lines.append(f"  {field.name}: {value}")
    return "\n".join(lines)
