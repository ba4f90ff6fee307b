//! Both crates' CUDA types in one program: candle's device and stream, ringattn's backend on
//! candle's stream.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = candle_core::Device::new_cuda(0)?;
    let stream = device.as_cuda_device()?.cuda_stream();
    let gpu = ringattn::cuda::CudaDevice::shared(0)?;
    let backend = ringattn::cuda::DeviceBackend::on_stream(gpu, stream, ringattn::DType::BF16)?;
    println!("{backend:?}");
    Ok(())
}
