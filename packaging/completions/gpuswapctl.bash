# bash completion for gpuswapctl(1)                                    -*- shell-script -*-
# Installed as /usr/share/bash-completion/completions/gpuswapctl.

# The instances with a socket: NAME.sock is gpuswapd@NAME, gpuswapd.sock is "default".
_gpuswapctl_instances() {
    local sock name
    for sock in "${GPUSWAPD_RUNTIME_DIR:-/run/gpuswapd}"/*.sock; do
        [[ -S $sock ]] || continue
        name=${sock##*/}
        name=${name%.sock}
        [[ $name == gpuswapd ]] && name=default
        printf '%s\n' "$name"
    done
}

_gpuswapctl() {
    local cur prev words cword split
    _init_completion -s || return

    local commands="acquire renew release run status plan park history watch bench slurm-prolog slurm-epilog slurm-reconcile"
    local common="--socket --instance --json -h --help"
    local -A options=(
        [acquire]="--for --holder --no-wait --timeout --profile --priority"
        [renew]="--for --holder"
        [release]="--holder"
        [run]="--for --holder --timeout --profile --priority --"
        [status]="--all"
        [plan]="--profile"
        [park]="--remove"
        [history]="--limit"
        [watch]=""
        [slurm-prolog]=""
        [slurm-epilog]=""
        [slurm-reconcile]=""
        [bench]="--prompts --url --model --max-tokens --repeat --for --no-lease --profile --priority"
    )
    local spans="90s 5m 15m 30m 1h 4h"

    # The command, and for run the start of COMMAND after "--".
    local i command=""
    for ((i = 1; i < cword; i++)); do
        case ${words[i]} in
            --socket | --instance | --for | --holder | --timeout | --limit | --prompts | --url | --model | \
                --max-tokens | --repeat | --profile | --priority) ((i++)) ;;
            --)
                if [[ $command == run ]]; then
                    _command_offset $((i + 1))
                    return
                fi
                ;;
            -*) ;;
            *) [[ -z $command ]] && command=${words[i]} ;;
        esac
    done

    case $prev in
        --socket)
            _filedir
            return
            ;;
        --instance)
            COMPREPLY=($(compgen -W "$(_gpuswapctl_instances)" -- "$cur"))
            return
            ;;
        --prompts)
            COMPREPLY=($(compgen -W "chat long-context" -- "$cur"))
            _filedir jsonl
            return
            ;;
        --for | --timeout)
            COMPREPLY=($(compgen -W "$spans" -- "$cur"))
            return
            ;;
        --holder | --limit | --url | --model | --max-tokens | --repeat | --priority)
            return
            ;;
        --profile)
            COMPREPLY=($(compgen -W "default" -- "$cur"))
            return
            ;;
    esac
    $split && return

    if [[ -z $command ]]; then
        COMPREPLY=($(compgen -W "$commands $common" -- "$cur"))
    elif [[ -v "options[$command]" ]]; then
        COMPREPLY=($(compgen -W "${options[$command]} $common" -- "$cur"))
    fi
} &&
    complete -F _gpuswapctl gpuswapctl
