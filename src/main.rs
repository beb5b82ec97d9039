//! Thin entry point: everything, the command line included, is in the library
//! (`seckill::cli::main`), so the roles are compiled once.

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    seckill::cli::main()
}
