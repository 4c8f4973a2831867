//! Fault injection for the failure tests: `TOONFLOW_CUDA_FAULT` holds a comma-separated list of
//! `compile`, `alloc`, `capture`. Each makes the real operation fail, not a stand-in for it:
//! the kernel source gets an `#error`, every device allocation (`alloc::allocate`: the arenas,
//! the overlap landing slot) asks the driver for four times the free memory, and the capture
//! issues a stream synchronisation, which capture forbids.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Compile,
    Alloc,
    Capture,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Compile => "compile",
            Fault::Alloc => "alloc",
            Fault::Capture => "capture",
        }
    }
}

/// Whether `fault` is requested now (read on every call, so a test can switch it).
pub fn injected(fault: Fault) -> bool {
    std::env::var("TOONFLOW_CUDA_FAULT")
        .map(|v| v.split(',').any(|f| f.trim() == fault.name()))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_means_no_fault() {
        // The variable is not set in the test environment of this crate.
        if std::env::var("TOONFLOW_CUDA_FAULT").is_err() {
            assert!(!injected(Fault::Compile));
            assert!(!injected(Fault::Alloc));
            assert!(!injected(Fault::Capture));
        }
    }
}
