//! Thin entry point: everything, the command line included, is in the library
//! (`seckill::cli::main`), so the roles are compiled once.

fn main() -> std::process::ExitCode {
    seckill::cli::main()
}
