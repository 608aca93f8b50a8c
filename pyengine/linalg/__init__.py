"""Layer 2: batched matrix-free operators, iterative solvers, spectral norms and radii, weight scans,
steepest-descent directions under norms."""

from .convert import as_linear_operator, from_linear_operator
from .dense import DenseOperator
from .norm_jacobians import LayerNormJacobian, RMSNormJacobian
from .operators import BatchedOperator, Identity, Product, Scaled, Sum
from .results import SpectralRadiusResult, SpectralResult, WeightScan
from .steepest import dual_norm, steepest_descent
from .spectral import layer_norm_spectral_norm, rms_norm_spectral_norm, spectral_norm, spectral_radius
from .weights import weight_scan

__all__ = [
    "BatchedOperator",
    "DenseOperator",
    "Identity",
    "LayerNormJacobian",
    "Product",
    "RMSNormJacobian",
    "Scaled",
    "SpectralRadiusResult",
    "SpectralResult",
    "Sum",
    "WeightScan",
    "as_linear_operator",
    "dual_norm",
    "from_linear_operator",
    "layer_norm_spectral_norm",
    "rms_norm_spectral_norm",
    "spectral_norm",
    "spectral_radius",
    "steepest_descent",
    "weight_scan",
]
