from rtrl.cli import main

main()
