"""The simulator: workloads and traces (``workload``), scenarios (``scenario``), the virtual-time
engine (``engine_model``), the discrete-event driver (``driver``) and reports (``report``)."""
