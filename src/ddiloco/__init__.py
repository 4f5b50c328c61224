"""ddiloco: Decoupled DiLoCo for resilient, low-communication distributed pre-training.

Independent learners train their own copy of a model at their own pace; a CPU syncer merges
fragment-wise pseudo-gradients once a minimum quorum has reported, weights them by tokens, averages
them with radial-directional averaging and applies an outer Nesterov step.
Paper: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training", arXiv 2604.21428.
"""

__version__ = "0.1.0"
