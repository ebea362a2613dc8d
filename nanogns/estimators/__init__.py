"""The gradient noise scale estimators."""
