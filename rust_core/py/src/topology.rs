use dapple_core::cluster::topology::Topology;
use pyo3::prelude::*;

use dapple_core::cost::{allreduce_ms, Cluster};

use crate::to_py_err;

crate::file_object_class!(
    /// A validated cluster (`dapple.topology`).
    PyTopology(Topology, "Topology")
);

crate::file_object_methods!(PyTopology {
    /// From a short spec (`2x8-nvlink`) or a preset name (`A`).
    #[staticmethod]
    fn from_spec(spec: &str) -> PyResult<PyTopology> {
        let inner = Topology::from_spec(spec).map_err(to_py_err)?;
        Ok(crate::Wraps::wrap(inner, None))
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }

    #[getter]
    fn num_devices(&self) -> u32 {
        self.inner.num_devices()
    }

    #[getter]
    fn num_machines(&self) -> usize {
        self.inner.num_machines()
    }

    /// Index of the machine that holds GPU `device`; None past the last GPU.
    fn machine_of(&self, device: u32) -> Option<usize> {
        self.inner.machine_of(device)
    }

    /// The cost model's AllReduce of `bytes` among GPUs `devices`, in ms:
    /// what `dapple topology measure` sets beside the measured one.
    fn allreduce_ms(&self, devices: Vec<u32>, bytes: f64) -> PyResult<f64> {
        let cluster = Cluster::new(&self.inner);
        let alloc = cluster.alloc_of(&devices).map_err(to_py_err)?;
        Ok(allreduce_ms(&cluster, &alloc, bytes))
    }

    /// One line: machines, GPUs, links.
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn __repr__(&self) -> String {
        format!("Topology({:?}, {} GPUs)", self.inner.name, self.inner.num_devices())
    }
});

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTopology>()?;
    Ok(())
}
