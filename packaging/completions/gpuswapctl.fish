# fish completion for gpuswapctl(1).
# Installed as /usr/share/fish/vendor_completions.d/gpuswapctl.fish.

set -l commands acquire renew release run status plan park history watch bench slurm-prolog slurm-epilog slurm-reconcile
set -l spans 90s 5m 15m 30m 1h 4h

# True while completing COMMAND (or its arguments) after "gpuswapctl run ... --".
function __gpuswapctl_after_dashdash
    set -l tokens (commandline -opc)
    contains -- run $tokens; and contains -- -- $tokens
end

# Hand what follows "run ... --" to the completions of that command.
function __gpuswapctl_complete_command
    set -l tokens (commandline -opc)
    set -l i (contains -i -- -- $tokens)
    set -l rest $tokens[(math $i + 1)..-1] (commandline -ct)
    complete -C (string join ' ' -- (string escape -- $rest))
end

# The instances with a socket: NAME.sock is gpuswapd@NAME, gpuswapd.sock is "default".
function __gpuswapctl_instances
    set -l dir /run/gpuswapd
    set -q GPUSWAPD_RUNTIME_DIR; and set dir $GPUSWAPD_RUNTIME_DIR
    for sock in $dir/*.sock
        test -S $sock; or continue
        string replace -r '^gpuswapd$' default -- (basename $sock .sock)
    end
end

complete -c gpuswapctl -f

# Every command, and gpuswapctl itself.
complete -c gpuswapctl -n 'not __gpuswapctl_after_dashdash' -l socket -r -F -d "gpuswapd's socket"
complete -c gpuswapctl -n 'not __gpuswapctl_after_dashdash' -l instance -x -a '(__gpuswapctl_instances)' -d 'The gpuswapd of gpuswapd@NAME'
complete -c gpuswapctl -n 'not __gpuswapctl_after_dashdash' -l json -d 'Print the reply as JSON'
complete -c gpuswapctl -n 'not __gpuswapctl_after_dashdash' -s h -l help -d 'Show help and exit'

complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a acquire -d 'Hold the GPU window (opening it if needed)'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a renew -d 'Extend a lease'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a release -d 'Give a lease back'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a run -d 'Hold a lease while a command runs'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a status -d "The window's phase, leases and last timings"
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a plan -d 'What a window would do now (changes nothing)'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a park -d 'The engine parked asleep between windows'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a history -d 'Past windows with their phase timings'
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a watch -d "Follow the window's events as they happen"
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a bench -d "Measure the window's engine under a lease"
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a slurm-prolog -d "Slurm node Prolog: hold the job's GPUs"
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a slurm-epilog -d "Slurm node Epilog: release the job's GPUs"
complete -c gpuswapctl -n "not __fish_seen_subcommand_from $commands" -a slurm-reconcile -d 'Release the leases of Slurm jobs that no longer run'

# acquire
complete -c gpuswapctl -n '__fish_seen_subcommand_from acquire' -l for -x -a "$spans" -d 'Lease duration'
complete -c gpuswapctl -n '__fish_seen_subcommand_from acquire' -l holder -x -d 'Who holds the lease'
complete -c gpuswapctl -n '__fish_seen_subcommand_from acquire' -l no-wait -d 'Fail at once unless a window is open'
complete -c gpuswapctl -n '__fish_seen_subcommand_from acquire' -l timeout -x -a "$spans" -d 'Give up if not ready within SPAN'
complete -c gpuswapctl -n '__fish_seen_subcommand_from acquire plan bench' -l profile -x -a default -d 'The kind of window ([profiles.NAME])'
complete -c gpuswapctl -n '__fish_seen_subcommand_from acquire bench' -l priority -x -d 'Queue priority (a higher one preempts)'
complete -c gpuswapctl -n '__fish_seen_subcommand_from run; and not __gpuswapctl_after_dashdash' -l priority -x -d 'Queue priority (a higher one preempts)'
complete -c gpuswapctl -n '__fish_seen_subcommand_from run; and not __gpuswapctl_after_dashdash' -l profile -x -a default -d 'The kind of window (bare: CUDA_VISIBLE_DEVICES)'

# renew [LEASE]
complete -c gpuswapctl -n '__fish_seen_subcommand_from renew' -l for -x -a "$spans" -d 'New duration from now'
complete -c gpuswapctl -n '__fish_seen_subcommand_from renew' -l holder -x -d 'Whose lease'

# release [LEASE]
complete -c gpuswapctl -n '__fish_seen_subcommand_from release' -l holder -x -d 'Whose leases'

# run [options] -- COMMAND [ARG...]
complete -c gpuswapctl -n '__fish_seen_subcommand_from run; and not __gpuswapctl_after_dashdash' -l for -x -a "$spans" -d 'Lease duration, renewed while COMMAND runs'
complete -c gpuswapctl -n '__fish_seen_subcommand_from run; and not __gpuswapctl_after_dashdash' -l holder -x -d 'Who holds the lease'
complete -c gpuswapctl -n '__fish_seen_subcommand_from run; and not __gpuswapctl_after_dashdash' -l timeout -x -a "$spans" -d 'Give up if not ready within SPAN'
complete -c gpuswapctl -n '__fish_seen_subcommand_from run; and not __gpuswapctl_after_dashdash' -a -- -d 'End of options: the command follows'
complete -c gpuswapctl -n __gpuswapctl_after_dashdash -x -a '(__gpuswapctl_complete_command)'

# status
complete -c gpuswapctl -n '__fish_seen_subcommand_from status' -l all -d 'Every instance: phase, leases, GPU'

# park
complete -c gpuswapctl -n '__fish_seen_subcommand_from park' -l remove -d 'Remove the parked engine now'

# history
complete -c gpuswapctl -n '__fish_seen_subcommand_from history' -l limit -x -d 'How many windows'

# bench
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l prompts -r -F -a 'chat long-context' -d 'A built-in set or a JSONL file'
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l url -x -d 'Chat completions URL'
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l model -x -d 'Model name'
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l max-tokens -x -d 'max_tokens per request'
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l repeat -x -d 'Run the set N times'
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l for -x -a "$spans" -d 'Lease duration, renewed while it runs'
complete -c gpuswapctl -n '__fish_seen_subcommand_from bench' -l no-lease -d 'Take no lease'
