//! A bf16 GEMM on one GPU (`kernels/gemm.cu`, PTX committed beside it): the stand-in for a
//! model's compute when measuring what the copy kernel takes from it (`ferry bench --contend`).
//! A [`Gemm`] multiplies over and over on a stream of its own and reports how many
//! multiplications finished per second ([`GemmRate`]).

use ferry_core::cuda::{Context, DeviceBuffer, Event, Kernel, KernelArg, Module, Stream};
use ferry_core::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const GEMM_PTX: &str = include_str!("../kernels/gemm.ptx");

/// Rows and columns of C one thread block computes (`TILE` of gemm.cu); n must be a multiple.
pub const GEMM_TILE: usize = 128;

/// Largest n taken: its grid of (n / 128)^2 blocks stays far inside a launch's limit.
const MOST_N: usize = 65_536;

/// Threads per block (`THREADS` of gemm.cu).
const THREADS_PER_BLOCK: u32 = 256;

/// How long the host sleeps between looks at a multiplication's end.
const LOOK_EVERY: Duration = Duration::from_micros(20);

/// `C = A * B` for square row-major `n x n` matrices on one GPU: A and B bf16, C fp32, with
/// A and B filled once with small integers ([`Gemm::a_value`], [`Gemm::b_value`]) so that every
/// product and sum is exact.
#[derive(Debug)]
pub struct Gemm {
    kernel: Kernel,
    stream: Stream,
    n: usize,
    a: DeviceBuffer,
    b: DeviceBuffer,
    c: DeviceBuffer,
}

impl Gemm {
    /// Allocates and fills the matrices on `context`'s GPU and loads the kernel.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when `n` is not a positive multiple of [`GEMM_TILE`] or its
    /// matrices do not fit the address space; the driver's error when the GPU is out of memory
    /// or refuses the kernel.
    pub fn new(context: Arc<Context>, n: usize) -> Result<Gemm> {
        let elements = checked_elements(n)?;
        let module = Module::load(Arc::clone(&context), GEMM_PTX)?;
        let kernel = module.kernel("ferry_gemm_bf16")?;
        let a = DeviceBuffer::new(Arc::clone(&context), elements * 2)?;
        let b = DeviceBuffer::new(Arc::clone(&context), elements * 2)?;
        let c = DeviceBuffer::new(Arc::clone(&context), elements * 4)?;
        a.write_at(0, &bf16_matrix(n, Gemm::a_value))?;
        b.write_at(0, &bf16_matrix(n, Gemm::b_value))?;
        Ok(Gemm {
            kernel,
            stream: Stream::new(context)?,
            n,
            a,
            b,
            c,
        })
    }

    /// Element `(row, col)` of A: an integer in -2..=2.
    pub fn a_value(row: usize, col: usize) -> f32 {
        ((row * 7 + col * 3) % 5) as f32 - 2.0
    }

    /// Element `(row, col)` of B: an integer in -2..=2.
    pub fn b_value(row: usize, col: usize) -> f32 {
        ((row * 5 + col * 11 + 1) % 5) as f32 - 2.0
    }

    /// Rows (and columns) of the matrices.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Multiplies once and waits for it.
    ///
    /// # Errors
    /// The driver's error.
    pub fn multiply(&self) -> Result<()> {
        let launched = self.launch();
        let drained = self.stream.synchronize();
        launched?;
        Ok(drained?)
    }

    /// C as the last multiplication left it, row-major.
    ///
    /// # Errors
    /// The driver's error.
    pub fn result(&self) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; self.c.len()];
        self.c.read_at(0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|word| f32::from_le_bytes([word[0], word[1], word[2], word[3]]))
            .collect())
    }

    /// Multiplies back to back for `window` and reports the rate.
    ///
    /// # Errors
    /// The driver's error.
    pub fn rate_for(&self, window: Duration) -> Result<GemmRate> {
        self.rate_while(|| (), |elapsed| elapsed < window)
    }

    /// Multiplies back to back until `stop` is set and reports the rate. `opened` is called
    /// once the GPU is busy and the measured window opens: start what should run beside the
    /// multiplications then.
    ///
    /// # Errors
    /// The driver's error.
    pub fn rate_until(&self, stop: &AtomicBool, opened: impl FnOnce()) -> Result<GemmRate> {
        self.rate_while(opened, |_| !stop.load(Ordering::Acquire))
    }

    /// Keeps two multiplications queued while `more(time since the window opened)`, so one
    /// runs while the next waits behind it and the GPU never idles while the host notices an
    /// end; counts those that end inside the window. Waits for everything queued before
    /// returning, also on failure.
    fn rate_while(
        &self,
        opened: impl FnOnce(),
        mut more: impl FnMut(Duration) -> bool,
    ) -> Result<GemmRate> {
        let counted = (|| {
            let first = self.queue()?;
            let mut behind = self.queue()?;
            wait(&first)?;
            let started = Instant::now();
            opened();
            let (mut multiplications, mut last) = (0, started);
            while more(started.elapsed()) {
                let queued = self.queue()?;
                wait(&behind)?;
                behind = queued;
                multiplications += 1;
                last = Instant::now();
            }
            Ok::<_, Error>(GemmRate {
                n: self.n,
                multiplications,
                seconds: (last - started).as_secs_f64(),
            })
        })();
        let drained = self.stream.synchronize();
        let rate = counted?;
        drained?;
        Ok(rate)
    }

    /// Queues one multiplication and an event after it.
    fn queue(&self) -> Result<Event> {
        self.launch()?;
        Ok(Event::record(&self.stream)?)
    }

    /// Queues one multiplication on the stream.
    fn launch(&self) -> Result<()> {
        let tiles = (self.n / GEMM_TILE) as u32;
        let args = [
            KernelArg::U64(self.a.addr()),
            KernelArg::U64(self.b.addr()),
            KernelArg::U64(self.c.addr()),
            KernelArg::U32(self.n as u32),
        ];
        // SAFETY: the arguments are ferry_gemm_bf16's (two bf16 pointers, an fp32 pointer and
        // n as u32, which `checked_elements` bounded), and its blocks read and write only the
        // n x n elements of A, B and C, which those allocations hold (sized from the same n
        // at construction); every method that queues work waits for the stream before it
        // returns, so the buffers, which `self` owns, outlive every launch.
        unsafe {
            self.kernel
                .launch(&self.stream, tiles * tiles, THREADS_PER_BLOCK, &args)
        }
    }
}

/// Elements of one `n x n` matrix, when `n` is a positive multiple of [`GEMM_TILE`] up to
/// [`MOST_N`].
fn checked_elements(n: usize) -> Result<usize> {
    match n > 0 && n % GEMM_TILE == 0 && n <= MOST_N {
        true => Ok(n * n),
        false => Err(Error::ApiMisuse(format!(
            "Gemm::new: n = {n} is not a positive multiple of {GEMM_TILE} up to {MOST_N}; pass \
             one such as 4096"
        ))),
    }
}

/// The `n x n` matrix `value(row, col)` as little-endian bf16, row-major. The values are small
/// integers, which bf16 holds exactly: its bits are the fp32 bits' upper half.
fn bf16_matrix(n: usize, value: fn(usize, usize) -> f32) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(n * n * 2);
    for row in 0..n {
        for col in 0..n {
            let bits = (value(row, col).to_bits() >> 16) as u16;
            bytes.extend_from_slice(&bits.to_le_bytes());
        }
    }
    bytes
}

/// Waits for the multiplication before `event` to end.
fn wait(event: &Event) -> Result<()> {
    while !event.query()? {
        std::thread::sleep(LOOK_EVERY);
    }
    Ok(())
}

/// How fast a [`Gemm`] multiplied over one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmRate {
    /// Rows (and columns) of the matrices.
    pub n: usize,
    /// Multiplications that ended inside the window.
    pub multiplications: u64,
    /// The window's length, from the end of the multiplication before it to the last one's.
    pub seconds: f64,
}

impl GemmRate {
    /// Multiplications per second; 0 for an empty window.
    pub fn per_second(&self) -> f64 {
        match self.seconds > 0.0 {
            true => self.multiplications as f64 / self.seconds,
            false => 0.0,
        }
    }

    /// Tensor-core throughput, 10^12 floating-point operations per second (2 n^3 per
    /// multiplication).
    pub fn tflops(&self) -> f64 {
        let n = self.n as f64;
        self.per_second() * 2.0 * n * n * n / 1e12
    }
}

#[cfg(all(test, feature = "gpu-tests"))]
mod gpu_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_be_positive_multiples_of_the_tile() {
        assert_eq!(checked_elements(256).ok(), Some(65_536));
        assert_eq!(checked_elements(4096).ok(), Some(1 << 24));
        assert!(checked_elements(MOST_N).is_ok());
        for n in [0, 100, 4095, MOST_N + GEMM_TILE, usize::MAX / 128 * 128] {
            assert!(
                matches!(checked_elements(n), Err(Error::ApiMisuse(_))),
                "n = {n}"
            );
        }
    }

    #[test]
    fn the_inputs_are_small_integers_that_bf16_holds_exactly() {
        let bytes = bf16_matrix(128, Gemm::a_value);
        for (index, pair) in bytes.chunks_exact(2).enumerate() {
            let bits = u32::from(u16::from_le_bytes([pair[0], pair[1]])) << 16;
            let value = Gemm::a_value(index / 128, index % 128);
            assert_eq!(f32::from_bits(bits), value, "element {index}");
            assert!((-2.0..=2.0).contains(&value) && value.fract() == 0.0);
        }
    }

    #[test]
    fn rates_count_multiplications_over_the_window() {
        let rate = GemmRate {
            n: 4096,
            multiplications: 500,
            seconds: 0.5,
        };
        assert_eq!(rate.per_second(), 1000.0);
        assert!((rate.tflops() - 137.438_953_472).abs() < 1e-9);
        let empty = GemmRate {
            multiplications: 0,
            seconds: 0.0,
            ..rate
        };
        assert_eq!(empty.per_second(), 0.0);
        assert_eq!(empty.tflops(), 0.0);
    }
}
