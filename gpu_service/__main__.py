from gpu_service.cli import main

main()
