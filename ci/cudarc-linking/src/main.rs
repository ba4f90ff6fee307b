//! cudarc as candle links it, and ringattn's CUDA types, in one program.

fn main() {
    let linked = std::any::type_name::<cudarc::driver::CudaContext>();
    let ours = std::any::type_name::<ringattn::cuda::DeviceBackend>();
    println!("{linked} beside {ours}");
}
