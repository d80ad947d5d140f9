from expert_service.cli import main

main()
