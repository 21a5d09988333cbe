from persrag_lightning.cli import main

if __name__ == "__main__":  # spawned children (vLLM's engine core, DataLoader workers) re-import this file
    main()
